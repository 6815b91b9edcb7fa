package mcp

import (
	"context"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// Image is a catalogue entry as vm_create's caller chooses by it.
type Image struct {
	Name         string `json:"name" jsonschema:"what vm_create's image takes"`
	Description  string `json:"description,omitempty"`
	OS           string `json:"os,omitempty"`
	OSVersion    string `json:"os_version,omitempty"`
	Architecture string `json:"architecture,omitempty"`
	LoginUser    string `json:"login_user,omitempty"`
	MinDiskGB    int64  `json:"min_disk_gb,omitempty" jsonschema:"vm_create's disk_gb must be at least this"`
	MinMemMB     int64  `json:"min_mem_mb,omitempty" jsonschema:"vm_create's mem_mb must be at least this"`
	Version      int64  `json:"version" jsonschema:"the current version, which a create gets"`
	SHA256       string `json:"sha256"`
}

// ImageListIn takes nothing.
type ImageListIn struct{}

// ImageListOut is the catalogue.
type ImageListOut struct {
	Images []Image `json:"images"`
}

func (t *tools) registerImages(s *mcp.Server) {
	addTool(t, s, &mcp.Tool{
		Name:        "image_list",
		Description: "List the image catalogue: the names vm_create takes as image, with what each is and the least disk and memory a VM of it needs.",
	}, t.imageList)
}

func (t *tools) imageList(ctx context.Context, _ *mcp.CallToolRequest, _ ImageListIn) (ImageListOut, error) {
	list, err := t.f.ListImages(ctx)
	if err != nil {
		return ImageListOut{}, err
	}
	out := ImageListOut{Images: make([]Image, 0, len(list))}
	for _, i := range list {
		p := i.GetProperties()
		out.Images = append(out.Images, Image{
			Name: i.GetName(), Description: p.GetDescription(), OS: p.GetOs(), OSVersion: p.GetOsVersion(),
			Architecture: p.GetArchitecture(), LoginUser: p.GetLoginUser(), MinDiskGB: p.GetMinDiskGb(), MinMemMB: p.GetMinMemMb(),
			Version: i.GetCurrent().GetVersion(), SHA256: i.GetCurrent().GetSha256(),
		})
	}
	return out, nil
}
