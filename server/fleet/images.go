package fleet

import (
	"context"
	"errors"
	"net/url"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/imagesource"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/bounds"
)

// KeptImageVersions is how many versions of a name the catalogue keeps.
const KeptImageVersions = 5

// Bounds on a catalogue entry's text.
const (
	maxImageWordLen        = 63
	maxImageDescriptionLen = 1024
	maxSumsFileNameLen     = 255
)

// The store's words for ImageReadiness ("" is the host's default).
var readinessWords = map[eitriv1.ImageReadiness]string{
	eitriv1.ImageReadiness_IMAGE_READINESS_UNSPECIFIED: "",
	eitriv1.ImageReadiness_IMAGE_READINESS_CLOUD_INIT:  "cloud-init",
	eitriv1.ImageReadiness_IMAGE_READINESS_SSH:         "ssh",
	eitriv1.ImageReadiness_IMAGE_READINESS_ADDRESS:     "address",
}

func readinessOf(word string) eitriv1.ImageReadiness {
	for r, w := range readinessWords {
		if w == word {
			return r
		}
	}
	return eitriv1.ImageReadiness_IMAGE_READINESS_UNSPECIFIED
}

func checkHTTPURL(field, v string) error {
	if err := checkLen(field, v, bounds.MaxURLLen); err != nil {
		return err
	}
	u, err := url.Parse(v)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return invalid(field, "%q is not an http(s) URL", v)
	}
	return nil
}

func validateImageProperties(p *eitriv1.ImageProperties) error {
	for _, c := range []struct {
		field, v string
		max      int
	}{
		{"properties.os", p.GetOs(), maxImageWordLen},
		{"properties.os_version", p.GetOsVersion(), maxImageWordLen},
		{"properties.architecture", p.GetArchitecture(), maxImageWordLen},
		{"properties.login_user", p.GetLoginUser(), maxImageWordLen},
		{"properties.description", p.GetDescription(), maxImageDescriptionLen},
	} {
		if err := checkLen(c.field, c.v, c.max); err != nil {
			return err
		}
	}
	switch {
	case p.GetMinDiskGb() < 0 || p.GetMinDiskGb() > bounds.MaxDiskGB:
		return invalid("properties.min_disk_gb", "must be between 0 and %d, got %d", bounds.MaxDiskGB, p.GetMinDiskGb())
	case p.GetMinMemMb() < 0 || p.GetMinMemMb() > bounds.MaxMemMB:
		return invalid("properties.min_mem_mb", "must be between 0 and %d, got %d", bounds.MaxMemMB, p.GetMinMemMb())
	}
	if _, ok := readinessWords[p.GetReadiness()]; !ok {
		return invalid("properties.readiness", "unknown readiness %d", p.GetReadiness())
	}
	return nil
}

func validateAddImage(r *eitriv1.AddImageRequest) error {
	if err := checkLen("name", r.GetName(), bounds.MaxNameLen); err != nil {
		return err
	}
	if !dnsLabel.MatchString(r.GetName()) {
		return invalid("name", "%q is not a DNS label (lowercase letters, digits and '-', 1-63 characters)", r.GetName())
	}
	if r.GetUrl() == "" {
		return invalid("url", "required")
	}
	if err := checkHTTPURL("url", r.GetUrl()); err != nil {
		return err
	}
	switch {
	case r.GetSha256() == "" && r.GetSumsUrl() == "":
		return invalid("sha256", "give the image's sha256, or sums_url to read it from")
	case r.GetSha256() != "" && r.GetSumsUrl() != "":
		return invalid("sha256", "give either sha256 or sums_url, not both")
	case r.GetSha256() != "" && !sha256Re.MatchString(strings.ToLower(r.GetSha256())):
		return invalid("sha256", "must be 64 hex characters")
	}
	if r.GetSumsUrl() != "" {
		if err := checkHTTPURL("sums_url", r.GetSumsUrl()); err != nil {
			return err
		}
	}
	if err := checkLen("sums_file_name", r.GetSumsFileName(), maxSumsFileNameLen); err != nil {
		return err
	}
	switch {
	case r.GetSumsSignatureUrl() != "" && r.GetSumsUrl() == "":
		return invalid("sums_signature_url", "needs sums_url: the signature is over the SUMS file")
	case r.GetSumsSignatureUrl() != "" && len(r.GetKeyring()) == 0:
		return invalid("keyring", "required with sums_signature_url: the keys the signature must be made by")
	case r.GetSumsSignatureUrl() == "" && len(r.GetKeyring()) > 0:
		return invalid("keyring", "only with sums_signature_url: without a signature there is nothing to check it against")
	}
	if r.GetSumsSignatureUrl() != "" {
		if err := checkHTTPURL("sums_signature_url", r.GetSumsSignatureUrl()); err != nil {
			return err
		}
		if err := imagesource.CheckKeyring(r.GetKeyring()); err != nil {
			return sourceErr(err)
		}
	}
	return validateImageProperties(r.GetProperties())
}

// sourceErr words a resolve failure: a fault in a field the admin gave is
// InvalidArgument naming it; the caller's own deadline passes through.
func sourceErr(err error) error {
	if fe, ok := errors.AsType[*imagesource.FieldError](err); ok {
		return invalid(fe.Field, "%v", fe.Err)
	}
	return err
}

func (f *Fleet) fetcher() imagesource.Fetcher {
	return imagesource.Fetcher{Policy: f.cfg.ImagePolicy}
}

// AddImage puts a name in the catalogue (admins only). With a SUMS file
// the digest is resolved, signature and bytes checked, before anything is
// written: a failed add leaves nothing behind.
func (f *Fleet) AddImage(ctx context.Context, r *eitriv1.AddImageRequest) (*eitriv1.Image, error) {
	p, err := requireAdmin(ctx)
	if err != nil {
		return nil, err
	}
	if err := validateAddImage(r); err != nil {
		return nil, err
	}
	if _, err := f.st.Image(ctx, r.GetName()); err == nil {
		return nil, errorf(Conflict, "name: an image named %q is already in the catalogue", r.GetName())
	}
	props := r.GetProperties()
	img := store.Image{
		Name: r.GetName(), OS: props.GetOs(), OSVersion: props.GetOsVersion(), Architecture: props.GetArchitecture(),
		LoginUser: props.GetLoginUser(), Description: props.GetDescription(), MinDiskGB: props.GetMinDiskGb(), MinMemMB: props.GetMinMemMb(),
		Readiness: readinessWords[props.GetReadiness()], URL: r.GetUrl(), SumsURL: r.GetSumsUrl(), SumsSignatureURL: r.GetSumsSignatureUrl(),
		SumsFileName: r.GetSumsFileName(), Keyring: r.GetKeyring(),
	}
	v := store.ImageVersion{URL: r.GetUrl(), SHA256: strings.ToLower(r.GetSha256()), AddedBy: p.UserID}
	if r.GetSumsUrl() != "" {
		if v, err = f.resolveImage(ctx, img, p.UserID); err != nil {
			return nil, err
		}
	}
	if err := f.st.CreateImage(ctx, img, v); err != nil {
		return nil, storeErr(err, "image "+img.Name)
	}
	f.publishImage(ctx, img.Name)
	return f.GetImage(ctx, img.Name)
}

func (f *Fleet) resolveImage(ctx context.Context, img store.Image, by string) (store.ImageVersion, error) {
	res, err := f.fetcher().Resolve(ctx, imagesource.Source{URL: img.URL, SumsURL: img.SumsURL, SignatureURL: img.SumsSignatureURL,
		FileName: img.SumsFileName, Keyring: img.Keyring}, f.now())
	if err != nil {
		return store.ImageVersion{}, sourceErr(err)
	}
	at := res.VerifiedAt
	return store.ImageVersion{URL: img.URL, SHA256: res.SHA256, SHA512: res.SHA512, Size: res.Size, SumsURL: img.SumsURL,
		SumsSignatureURL: img.SumsSignatureURL, Signer: res.Signer, VerifiedAt: &at, AddedBy: by}, nil
}

// RefreshImage resolves a name again from its SUMS source (admins only).
func (f *Fleet) RefreshImage(ctx context.Context, r *eitriv1.RefreshImageRequest) (*eitriv1.Image, bool, error) {
	p, err := requireAdmin(ctx)
	if err != nil {
		return nil, false, err
	}
	img, err := f.st.Image(ctx, r.GetName())
	if err != nil {
		return nil, false, storeErr(err, "image "+r.GetName())
	}
	if img.SumsURL == "" {
		return nil, false, errorf(Precondition, "image %s was added with a fixed sha256; there is no SUMS file to refresh it from (remove and add it again)", img.Name)
	}
	if r.GetUrl() != "" {
		if err := checkHTTPURL("url", r.GetUrl()); err != nil {
			return nil, false, err
		}
		img.URL = r.GetUrl()
	}
	v, err := f.resolveImage(ctx, img, p.UserID)
	if err != nil {
		return nil, false, err
	}
	got, changed, err := f.st.AdvanceImage(ctx, img.Name, v, KeptImageVersions)
	if err != nil {
		return nil, false, storeErr(err, "image "+img.Name)
	}
	for _, h := range pulledTo(ctx, f, img.Name) {
		f.kick(h) // the hosts holding it fetch the new version
	}
	view, err := f.imageView(ctx, got)
	if err == nil && changed && f.Images.Watchers() > 0 {
		f.Images.Publish(watch.Event[*eitriv1.Image]{ID: img.Name, Obj: view})
	}
	return view, changed, err
}

// pulledTo lists the hosts name was pulled to; none when that cannot be
// read (the hosts learn at their next snapshot).
func pulledTo(ctx context.Context, f *Fleet, name string) []string {
	hosts, err := f.st.ImagePullHosts(ctx, name)
	if err != nil {
		f.log.Warn("listing an image's hosts", "image", name, "err", err)
	}
	return hosts
}

// DeleteImage removes a name from the catalogue (admins only). VMs made
// from it keep their digest; hosts it was pulled to unpin it.
func (f *Fleet) DeleteImage(ctx context.Context, name string) error {
	if _, err := requireAdmin(ctx); err != nil {
		return err
	}
	hosts := pulledTo(ctx, f, name)
	if err := f.st.DeleteImage(ctx, name); err != nil {
		return storeErr(err, "image "+name)
	}
	f.Images.Publish(watch.Event[*eitriv1.Image]{ID: name, Removed: true})
	for _, h := range hosts {
		f.kick(h)
	}
	return nil
}

// PullImage has hosts (by id, or all) fetch and pin the image's current
// version (admins only).
func (f *Fleet) PullImage(ctx context.Context, r *eitriv1.PullImageRequest) (*eitriv1.Image, error) {
	if _, err := requireAdmin(ctx); err != nil {
		return nil, err
	}
	if r.GetAll() == (len(r.GetHostIds()) > 0) {
		return nil, invalid("host_ids", "name the hosts, or set all")
	}
	hosts := r.GetHostIds()
	if r.GetAll() {
		list, err := f.st.ListHosts(ctx)
		if err != nil {
			return nil, err
		}
		hosts = nil
		for _, h := range list {
			hosts = append(hosts, h.ID)
		}
	}
	for _, id := range hosts {
		if err := checkLen("host_ids", id, bounds.MaxIDLen); err != nil {
			return nil, err
		}
		if _, err := f.st.HostByID(ctx, id); errors.Is(err, store.ErrNotFound) {
			return nil, invalid("host_ids", "no host %q", id)
		} else if err != nil {
			return nil, err
		}
	}
	if err := f.st.AddImagePulls(ctx, r.GetName(), hosts); err != nil {
		return nil, storeErr(err, "image "+r.GetName())
	}
	for _, h := range hosts {
		f.kick(h)
	}
	f.publishImage(ctx, r.GetName())
	return f.GetImage(ctx, r.GetName())
}

// wantedImages are the images pulled to a host, at their current
// versions, for its snapshot.
func (f *Fleet) wantedImages(ctx context.Context, hostID string) ([]*eitriv1.ImageWanted, error) {
	names, err := f.st.ImagePullsForHost(ctx, hostID)
	if err != nil {
		return nil, err
	}
	var out []*eitriv1.ImageWanted
	for _, n := range names {
		img, err := f.st.Image(ctx, n)
		if errors.Is(err, store.ErrNotFound) {
			continue // removed meanwhile
		} else if err != nil {
			return nil, err
		}
		if v, ok := img.CurrentVersion(); ok {
			out = append(out, &eitriv1.ImageWanted{Url: v.URL, Sha256: v.SHA256})
		}
	}
	return out, nil
}

// imageHosts says how each host the image was pulled to stands with its
// current version, from the hosts' live reports.
func (f *Fleet) imageHosts(ctx context.Context, img store.Image) ([]*eitriv1.ImageOnHost, error) {
	ids, err := f.st.ImagePullHosts(ctx, img.Name)
	if err != nil {
		return nil, err
	}
	cur, _ := img.CurrentVersion()
	var out []*eitriv1.ImageOnHost
	for _, id := range ids {
		on := &eitriv1.ImageOnHost{HostId: id, State: "unknown"}
		if h, err := f.st.HostByID(ctx, id); err == nil {
			on.HostName = h.Name
		}
		if live, ok := f.reg.Host(id); ok {
			for _, held := range live.Report.GetImages() {
				if held.GetSha256() != cur.SHA256 {
					continue
				}
				switch {
				case held.GetHeld():
					on.State = "held"
				case held.GetError() != "":
					on.State, on.Error = "failed", held.GetError()
				default:
					on.State, on.StatusDetail = "pulling", held.GetStatusDetail()
					if p := held.GetProgress(); p != nil {
						on.Progress = proto.CloneOf(p)
					}
				}
			}
		}
		out = append(out, on)
	}
	return out, nil
}

// GetImage reads one entry; every user may.
func (f *Fleet) GetImage(ctx context.Context, name string) (*eitriv1.Image, error) {
	if _, err := principal(ctx); err != nil {
		return nil, err
	}
	img, err := f.st.Image(ctx, name)
	if err != nil {
		return nil, storeErr(err, "image "+name)
	}
	return f.imageView(ctx, img)
}

// ListImages is the whole catalogue; every user may read it.
func (f *Fleet) ListImages(ctx context.Context) ([]*eitriv1.Image, error) {
	if _, err := principal(ctx); err != nil {
		return nil, err
	}
	list, err := f.st.ListImages(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]*eitriv1.Image, len(list))
	for i, img := range list {
		if out[i], err = f.imageView(ctx, img); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// PutImage makes the catalogue say name is the image at url with digest
// sha256, without a caller or a download: how a control plane lists an
// image it serves itself (eitri dev's test guest). An entry already there
// is pointed at the digest.
func (f *Fleet) PutImage(ctx context.Context, name, url, sha256 string, props *eitriv1.ImageProperties, by string) error {
	img := store.Image{
		Name: name, OS: props.GetOs(), OSVersion: props.GetOsVersion(), Architecture: props.GetArchitecture(),
		LoginUser: props.GetLoginUser(), Description: props.GetDescription(), MinDiskGB: props.GetMinDiskGb(), MinMemMB: props.GetMinMemMb(),
		Readiness: readinessWords[props.GetReadiness()], URL: url,
	}
	v := store.ImageVersion{URL: url, SHA256: sha256, AddedBy: by}
	err := f.st.CreateImage(ctx, img, v)
	if errors.Is(err, store.ErrConflict) {
		_, _, err = f.st.AdvanceImage(ctx, name, v, KeptImageVersions)
	}
	if err == nil {
		f.publishImage(ctx, name)
	}
	return err
}

func (f *Fleet) imageView(ctx context.Context, img store.Image) (*eitriv1.Image, error) {
	out := imageFields(img)
	var err error
	out.Hosts, err = f.imageHosts(ctx, img)
	return out, err
}

func imageFields(img store.Image) *eitriv1.Image {
	out := &eitriv1.Image{
		Name: img.Name,
		Properties: &eitriv1.ImageProperties{
			Os: img.OS, OsVersion: img.OSVersion, Architecture: img.Architecture, LoginUser: img.LoginUser,
			MinDiskGb: img.MinDiskGB, MinMemMb: img.MinMemMB, Description: img.Description, Readiness: readinessOf(img.Readiness),
		},
		SumsFileName:  img.SumsFileName,
		KeyringPinned: len(img.Keyring) > 0,
		CreatedAt:     timestamppb.New(img.CreatedAt),
		UpdatedAt:     timestamppb.New(img.UpdatedAt),
	}
	for _, v := range img.Versions {
		pv := &eitriv1.ImageVersion{
			Version: v.Version, Url: v.URL, Sha256: v.SHA256, Sha512: v.SHA512, Size: v.Size,
			Provenance: &eitriv1.ImageProvenance{SumsUrl: v.SumsURL, SumsSignatureUrl: v.SumsSignatureURL, Signer: v.Signer, AddedBy: v.AddedBy},
			CreatedAt:  timestamppb.New(v.CreatedAt),
		}
		if v.VerifiedAt != nil {
			pv.Provenance.VerifiedAt = timestamppb.New(*v.VerifiedAt)
		}
		out.Versions = append(out.Versions, pv)
		if v.Version == img.Current {
			out.Current = pv
		}
	}
	return out
}

// imageForCreate resolves a create's catalogue name to what the VM is made
// from, and refuses a size below the image's minimums naming the field.
func (f *Fleet) imageForCreate(ctx context.Context, r *eitriv1.CreateVMRequest) (store.Image, store.ImageVersion, error) {
	img, err := f.st.Image(ctx, r.GetImage())
	if errors.Is(err, store.ErrNotFound) {
		return img, store.ImageVersion{}, invalid("image", "no image named %q in the catalogue (eitri image ls)", r.GetImage())
	} else if err != nil {
		return img, store.ImageVersion{}, err
	}
	v, ok := img.CurrentVersion()
	if !ok {
		return img, v, errorf(Internal, "image %s has no current version", img.Name)
	}
	switch {
	case r.GetDiskGb() < img.MinDiskGB:
		return img, v, invalid("disk_gb", "image %s needs at least %d GiB of disk, got %d", img.Name, img.MinDiskGB, r.GetDiskGb())
	case r.GetMemMb() < img.MinMemMB:
		return img, v, invalid("mem_mb", "image %s needs at least %d MiB of memory, got %d", img.Name, img.MinMemMB, r.GetMemMb())
	}
	return img, v, nil
}
