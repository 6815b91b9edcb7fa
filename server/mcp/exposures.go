package mcp

import (
	"context"

	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/bounds"
)

// Exposure is a guest port published on its host.
type Exposure struct {
	ID          string            `json:"id"`
	VMID        string            `json:"vm_id"`
	HostID      string            `json:"host_id"`
	GuestPort   uint32            `json:"guest_port"`
	HostPort    uint32            `json:"host_port"`
	HostAddr    string            `json:"host_addr,omitempty" jsonschema:"where to connect: the host's address for lan, 127.0.0.1 for local; empty until the host has said"`
	Protocol    string            `json:"protocol" jsonschema:"tcp or udp"`
	Scope       string            `json:"scope" jsonschema:"lan or local"`
	State       string            `json:"state" jsonschema:"pending until the host has reported on it, then active or failed"`
	Reason      string            `json:"reason,omitempty" jsonschema:"the OS error when failed"`
	MaxSessions uint32            `json:"max_sessions" jsonschema:"cap on concurrent conversations; 0 means the host's default"`
	Sessions    *ExposureSessions `json:"sessions" jsonschema:"null until the host has counted"`
	CreatedAt   string            `json:"created_at,omitempty" jsonschema:"RFC 3339"`
}

// ExposureSessions is what the host counted on an exposure.
type ExposureSessions struct {
	Active  int64 `json:"active" jsonschema:"conversations held now"`
	Refused int64 `json:"refused" jsonschema:"callers turned away at the cap since the host's agent started"`
	Dropped int64 `json:"dropped" jsonschema:"conversations the host could not carry to the guest since its agent started"`
	// A pointer, so a host that counts sessions but not bytes says null
	// rather than a zero nobody measured.
	Carried *ExposureBytes `json:"carried" jsonschema:"payload bytes carried since the host's agent started; null when the host does not count bytes"`
}

// ExposureBytes is the payload a published port carried each way.
type ExposureBytes struct {
	In  int64 `json:"in" jsonschema:"bytes from callers to the guest"`
	Out int64 `json:"out" jsonschema:"bytes from the guest back to callers"`
}

// ExposureCreateIn is exposure_create's input: every field CreateExposure
// takes.
type ExposureCreateIn struct {
	VMID        string `json:"vm_id" jsonschema:"the VM's id, e.g. vm-k3j5x7q2m4n6p2r5"`
	GuestPort   uint32 `json:"guest_port" jsonschema:"the port in the guest"`
	HostPort    uint32 `json:"host_port,omitempty" jsonschema:"the port on the host; 0 or absent allocates one from the control plane's range (only an admin may name one outside it)"`
	Protocol    string `json:"protocol,omitempty" jsonschema:"tcp (the default) or udp"`
	Scope       string `json:"scope,omitempty" jsonschema:"lan (the default): reachable on the host's address; local: on the host's 127.0.0.1 only"`
	MaxSessions uint32 `json:"max_sessions,omitempty" jsonschema:"cap on concurrent conversations; 0 or absent means the host's default"`
}

// ExposureOut is one exposure.
type ExposureOut struct {
	Exposure Exposure `json:"exposure"`
}

// ExposureListIn optionally names a VM.
type ExposureListIn struct {
	VMID string `json:"vm_id,omitempty" jsonschema:"only this VM's exposures, e.g. vm-k3j5x7q2m4n6p2r5; absent lists every exposure you can see"`
}

// ExposureListOut is the exposures.
type ExposureListOut struct {
	Exposures []Exposure `json:"exposures"`
}

// ExposureIDIn names one exposure.
type ExposureIDIn struct {
	ID string `json:"id" jsonschema:"the exposure's id, e.g. x-h2d4f6g3j7k3l5m7 (exposure_list shows them)"`
}

// ExposureDeleteOut says which exposure went.
type ExposureDeleteOut struct {
	DeletedID string `json:"deleted_id"`
}

func (t *tools) registerExposures(s *mcp.Server) {
	addTool(t, s, &mcp.Tool{
		Name: "exposure_create",
		Description: "Publish a VM's guest port on its host, so it is reachable at host_addr:host_port. " +
			"It starts pending; exposure_list shows it active (or failed, with the reason) once the host has " +
			"opened it.",
		InputSchema: schemaFor[ExposureCreateIn](func(p map[string]*jsonschema.Schema) {
			idProp(p["vm_id"], exampleVMID)
			between(p["guest_port"], 1, bounds.MaxPort)
			between(p["host_port"], 0, bounds.MaxPort)
			oneOf(p["protocol"], "tcp", "udp")
			oneOf(p["scope"], "lan", "local")
		}),
	}, t.exposureCreate)
	addTool(t, s, &mcp.Tool{
		Name: "exposure_list",
		Description: "List the exposures of one VM, or every exposure you can see, with their state, address and traffic: " +
			"sessions open, refused and dropped, and payload bytes carried in and out since the host's agent started " +
			"(null where the host has not counted).",
		InputSchema: schemaFor[ExposureListIn](func(p map[string]*jsonschema.Schema) {
			length(p["vm_id"], 0, bounds.MaxIDLen)
			p["vm_id"].Examples = []any{exampleVMID}
		}),
	}, t.exposureList)
	addTool(t, s, &mcp.Tool{
		Name:        "exposure_delete",
		Description: "Unpublish a port: the host closes it at once.",
		InputSchema: schemaFor[ExposureIDIn](func(p map[string]*jsonschema.Schema) { idProp(p["id"], exampleExposureID) }),
	}, t.exposureDelete)
}

func (t *tools) exposureCreate(ctx context.Context, _ *mcp.CallToolRequest, in ExposureCreateIn) (ExposureOut, error) {
	e, err := t.f.CreateExposure(ctx, &eitriv1.CreateExposureRequest{
		VmId: in.VMID, GuestPort: in.GuestPort, HostPort: in.HostPort,
		Protocol: in.Protocol, Scope: in.Scope, MaxSessions: in.MaxSessions,
	})
	if err != nil {
		return ExposureOut{}, err
	}
	return ExposureOut{Exposure: exposureOut(e)}, nil
}

func (t *tools) exposureList(ctx context.Context, _ *mcp.CallToolRequest, in ExposureListIn) (ExposureListOut, error) {
	list, err := t.f.ListExposures(ctx, in.VMID)
	if err != nil {
		return ExposureListOut{}, err
	}
	out := ExposureListOut{Exposures: make([]Exposure, len(list))}
	for i, e := range list {
		out.Exposures[i] = exposureOut(e)
	}
	return out, nil
}

func (t *tools) exposureDelete(ctx context.Context, _ *mcp.CallToolRequest, in ExposureIDIn) (ExposureDeleteOut, error) {
	if err := t.f.DeleteExposure(ctx, in.ID); err != nil {
		return ExposureDeleteOut{}, err
	}
	return ExposureDeleteOut{DeletedID: in.ID}, nil
}

func exposureOut(e *eitriv1.Exposure) Exposure {
	out := Exposure{
		ID: e.GetId(), VMID: e.GetVmId(), HostID: e.GetHostId(),
		GuestPort: e.GetGuestPort(), HostPort: e.GetHostPort(), HostAddr: e.GetHostAddr(),
		Protocol: e.GetProtocol(), Scope: e.GetScope(), State: e.GetState(), Reason: e.GetReason(),
		MaxSessions: e.GetMaxSessions(), CreatedAt: rfc3339(e.GetCreatedAt()),
	}
	if s := e.GetSessions(); s != nil {
		out.Sessions = &ExposureSessions{Active: s.GetActive(), Refused: s.GetRefused(), Dropped: s.GetDropped()}
		if b := s.GetCarried(); b != nil {
			out.Sessions.Carried = &ExposureBytes{In: b.GetIn(), Out: b.GetOut()}
		}
	}
	return out
}
