package metrics_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os/exec"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/metrics/promtest"
	"github.com/a73x/eitri/wire/connclient"
)

const sha = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// fleet is a real control plane with one host running alice's and bob's
// VMs, driven over the real AgentService.
type fleet struct {
	t                 *testing.T
	url               string
	http              *http.Client
	admin, alice, bob string
	hostID            string
	alicesVM, bobsVM  *eitriv1.VM
	// alicesPort and bobsPort are counted by the host (see ports);
	// alicesQuiet never is.
	alicesPort, bobsPort, alicesQuiet *eitriv1.Exposure
	sync                              *connect.BidiStreamForClient[eitriv1.SyncRequest, eitriv1.SyncResponse]
}

func bearer(tok string) connect.ClientOption { return connect.WithInterceptors(connclient.Bearer(tok)) }

func newFleet(t *testing.T) *fleet {
	ctx := context.Background()
	s, err := server.New(ctx, server.Config{DataDir: t.TempDir(), Plaintext: true})
	require.NoError(t, err)
	ts := httptest.NewUnstartedServer(s.Handler())
	ts.EnableHTTP2 = true
	ts.StartTLS()
	t.Cleanup(func() { ts.Close(); s.Close() })
	f := &fleet{t: t, url: ts.URL, http: ts.Client(), admin: s.AdminToken}

	hosts := eitriv1connect.NewHostServiceClient(f.http, f.url, bearer(f.admin))
	jt, err := hosts.CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
	require.NoError(t, err)
	ac := eitriv1connect.NewAgentServiceClient(f.http, f.url)
	en, err := ac.Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: jt.Msg.Token, Hostname: "h1"}))
	require.NoError(t, err)
	f.hostID = en.Msg.HostId
	sctx, cancel := context.WithCancel(ctx)
	f.sync = eitriv1connect.NewAgentServiceClient(f.http, f.url, bearer(en.Msg.HostCredential)).Sync(sctx)
	t.Cleanup(func() {
		cancel()
		_ = f.sync.CloseRequest()
		_ = f.sync.CloseResponse()
	})
	require.NoError(t, f.sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Hello{Hello: &eitriv1.Hello{AgentVersion: "test"}}}))
	go func() {
		for {
			if _, err := f.sync.Receive(); err != nil {
				return
			}
		}
	}()
	capacity := &eitriv1.Capacity{Vcpus: 8, MemMb: 16384, DiskGb: 200}
	f.report(&eitriv1.ActualStateReport{Capacity: capacity})
	require.Eventually(t, func() bool {
		h, err := hosts.GetHost(ctx, connect.NewRequest(&eitriv1.GetHostRequest{Id: f.hostID}))
		return err == nil && h.Msg.Host.GetCapacity() != nil
	}, 10*time.Second, 5*time.Millisecond)

	tokens := eitriv1connect.NewTokenServiceClient(f.http, f.url, bearer(f.admin))
	user := func(name string) string {
		tok, err := tokens.CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "t", UserName: name}))
		require.NoError(t, err)
		return tok.Msg.Secret
	}
	f.alice, f.bob = user("alice"), user("bob")
	create := func(tok, name string) *eitriv1.VM {
		vm, err := eitriv1connect.NewVMServiceClient(f.http, f.url, bearer(tok)).CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{
			Name: name, ImageUrl: "http://images.test/guest.raw", ImageSha256: sha, Vcpus: 1, MemMb: 256, DiskGb: 2}))
		require.NoError(t, err)
		return vm.Msg.Vm
	}
	f.alicesVM, f.bobsVM = create(f.alice, "alices"), create(f.bob, "bobs")
	running := func(id string) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: id, Power: "running", Phase: "ready"}
	}
	f.report(&eitriv1.ActualStateReport{Capacity: capacity, Vms: []*eitriv1.ActualVM{running(f.alicesVM.Id), running(f.bobsVM.Id)}})
	vms := eitriv1connect.NewVMServiceClient(f.http, f.url, bearer(f.admin))
	require.Eventually(t, func() bool {
		v, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: f.bobsVM.Id}))
		return err == nil && v.Msg.Vm.GetActualPower() == "running"
	}, 10*time.Second, 5*time.Millisecond)

	publish := func(tok, vmID, protocol string) *eitriv1.Exposure {
		x, err := eitriv1connect.NewExposureServiceClient(f.http, f.url, bearer(tok)).CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{
			VmId: vmID, GuestPort: 80, Protocol: protocol}))
		require.NoError(t, err)
		return x.Msg.Exposure
	}
	f.alicesPort, f.bobsPort = publish(f.alice, f.alicesVM.Id, "tcp"), publish(f.bob, f.bobsVM.Id, "udp")
	f.alicesQuiet = publish(f.alice, f.alicesVM.Id, "udp")
	return f
}

// ports reports the host's exposures: alice's port has carried in and out
// bytes, bob's a fixed amount, and alice's quiet port is reported without
// counters (an agent that does not count).
func (f *fleet) ports(in, out int64) {
	counted := func(id string, in, out int64) *eitriv1.ExposureActual {
		return &eitriv1.ExposureActual{Id: id, State: "active", Sessions: &eitriv1.ExposureSessions{
			Active: 2, Refused: 3, Dropped: 4, Carried: &eitriv1.ExposureBytes{In: in, Out: out}}}
	}
	running := func(id string) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: id, Power: "running", Phase: "ready"}
	}
	f.report(&eitriv1.ActualStateReport{
		Capacity: &eitriv1.Capacity{Vcpus: 8, MemMb: 16384, DiskGb: 200},
		Vms:      []*eitriv1.ActualVM{running(f.alicesVM.Id), running(f.bobsVM.Id)},
		Exposures: []*eitriv1.ExposureActual{counted(f.alicesPort.Id, in, out), counted(f.bobsPort.Id, 77, 88),
			{Id: f.alicesQuiet.Id, State: "active"}},
	})
}

func (f *fleet) report(rep *eitriv1.ActualStateReport) {
	require.NoError(f.t, f.sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Report{Report: rep}}))
}

// sample sends a round of usage where alice's VM has used cpu seconds and
// sent netBytes.
func (f *fleet) sample(cpu float64, netBytes uint64) {
	now := timestamppb.Now()
	vm := func(id string, cpu float64) *eitriv1.VMUsage {
		return &eitriv1.VMUsage{VmId: id, At: now, CpuSeconds: proto.Float64(cpu), MemoryRssBytes: proto.Uint64(300 << 20),
			Disk: &eitriv1.DiskUsage{ReadBytes: 4096, WriteBytes: 8192, ReadOps: 1, WriteOps: 2},
			Net:  &eitriv1.NetUsage{ReceivedBytes: 1, SentBytes: netBytes, ReceivedPackets: 1, SentPackets: 2}}
	}
	require.NoError(f.t, f.sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Usage{Usage: &eitriv1.UsageSample{
		Host: &eitriv1.HostUsage{At: now, Cpus: 2, CpuBusySeconds: proto.Float64(1000), MemoryTotalBytes: proto.Uint64(8 << 30),
			MemoryAvailableBytes: proto.Uint64(6 << 30), Load: &eitriv1.LoadAverage{Load1: 0.5, Load5: 0.25, Load15: 0.1}},
		Vms: []*eitriv1.VMUsage{vm(f.alicesVM.Id, cpu), vm(f.bobsVM.Id, 99)},
	}}}))
}

func (f *fleet) scrape(tok string) (int, string) {
	req, err := http.NewRequest(http.MethodGet, f.url+server.MetricsPath, nil)
	require.NoError(f.t, err)
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := f.http.Do(req)
	require.NoError(f.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(f.t, err)
	return resp.StatusCode, string(b)
}

func parse(t *testing.T, body string) map[string]*dto.MetricFamily {
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(body))
	require.NoError(t, err)
	return fams
}

// value is the sample of family name whose "vm" (or "host") label is id.
func value(fams map[string]*dto.MetricFamily, name, id string) (float64, bool) {
	for _, m := range fams[name].GetMetric() {
		for _, l := range m.GetLabel() {
			if (l.GetName() == "vm" || l.GetName() == "host") && l.GetValue() == id {
				if c := m.GetCounter(); c != nil {
					return c.GetValue(), true
				}
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

// portValue is the sample of family name for exposure id (and direction,
// when not empty), and the sample's labels.
func portValue(fams map[string]*dto.MetricFamily, name, id, direction string) (float64, map[string]string, bool) {
	for _, m := range fams[name].GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		if labels["exposure"] != id || labels["direction"] != direction {
			continue
		}
		if c := m.GetCounter(); c != nil {
			return c.GetValue(), labels, true
		}
		return m.GetGauge().GetValue(), labels, true
	}
	return 0, nil, false
}

func TestAScrapeServesTheFleetAsTheTokenMaySeeIt(t *testing.T) {
	f := newFleet(t)
	f.ports(1500, 1<<33)
	f.sample(12.5, 4096)
	require.Eventually(t, func() bool {
		_, body := f.scrape(f.admin)
		fams := parse(t, body)
		_, vmOK := value(fams, "eitri_vm_cpu_seconds_total", f.bobsVM.Id)
		_, _, portOK := portValue(fams, "eitri_published_port_bytes_total", f.bobsPort.Id, "in")
		return vmOK && portOK
	}, 10*time.Second, 10*time.Millisecond)

	status, body := f.scrape(f.admin)
	require.Equal(t, http.StatusOK, status)
	fams := parse(t, body)
	cpu, ok := value(fams, "eitri_vm_cpu_seconds_total", f.alicesVM.Id)
	require.True(t, ok)
	assert.Equal(t, 12.5, cpu)
	assert.Equal(t, dto.MetricType_COUNTER, fams["eitri_vm_cpu_seconds_total"].GetType())
	sent, _ := value(fams, "eitri_vm_network_transmit_bytes_total", f.alicesVM.Id)
	assert.Equal(t, float64(4096), sent)
	labels := map[string]string{}
	for _, l := range fams["eitri_vm_cpu_seconds_total"].GetMetric()[0].GetLabel() {
		labels[l.GetName()] = l.GetValue()
	}
	assert.ElementsMatch(t, []string{"vm", "name", "host", "owner"}, keys(labels))
	assert.Equal(t, f.hostID, labels["host"])
	load, ok := value(fams, "eitri_host_load1", f.hostID)
	require.True(t, ok)
	assert.Equal(t, 0.5, load)
	capacity, _ := value(fams, "eitri_host_capacity_memory_bytes", f.hostID)
	assert.Equal(t, float64(16384<<20), capacity)
	_, ok = value(fams, "eitri_vm_memory_balloon_bytes", f.alicesVM.Id)
	assert.False(t, ok, "no balloon measured: no series, not 0")

	// Published ports: sessions and bytes as the host counted them, with
	// bounded labels only.
	in, portLabels, ok := portValue(fams, "eitri_published_port_bytes_total", f.alicesPort.Id, "in")
	require.True(t, ok)
	assert.Equal(t, 1500.0, in)
	assert.Equal(t, map[string]string{"exposure": f.alicesPort.Id, "vm": f.alicesVM.Id, "host": f.hostID, "protocol": "tcp", "direction": "in"}, portLabels)
	out, _, _ := portValue(fams, "eitri_published_port_bytes_total", f.alicesPort.Id, "out")
	assert.Equal(t, float64(1<<33), out)
	assert.Equal(t, dto.MetricType_COUNTER, fams["eitri_published_port_bytes_total"].GetType())
	for name, want := range map[string]float64{"eitri_published_port_sessions": 2, "eitri_published_port_refused_total": 3, "eitri_published_port_dropped_total": 4} {
		v, _, ok := portValue(fams, name, f.alicesPort.Id, "")
		assert.True(t, ok, name)
		assert.Equal(t, want, v, name)
	}
	assert.Equal(t, dto.MetricType_GAUGE, fams["eitri_published_port_sessions"].GetType())
	_, _, ok = portValue(fams, "eitri_published_port_sessions", f.alicesQuiet.Id, "")
	assert.False(t, ok, "a port its host does not count: no series, not 0")
	_, _, ok = portValue(fams, "eitri_published_port_bytes_total", f.bobsPort.Id, "out")
	assert.True(t, ok, "the admin sees bob's port too")

	// The control plane's own: its watch streams, for an admin.
	usageSt, err := eitriv1connect.NewUsageServiceClient(f.http, f.url, bearer(f.admin)).WatchUsage(context.Background(), connect.NewRequest(&eitriv1.WatchUsageRequest{}))
	require.NoError(t, err)
	require.True(t, usageSt.Receive())
	defer usageSt.Close()
	_, body = f.scrape(f.admin)
	usageWatchers := 0.0
	for _, m := range parse(t, body)["eitri_watchers"].GetMetric() {
		if m.GetLabel()[0].GetValue() == "usage" {
			usageWatchers = m.GetGauge().GetValue()
		}
	}
	assert.Equal(t, 1.0, usageWatchers, "the open usage stream is counted")

	// Alice's token sees her VM and not bob's.
	status, body = f.scrape(f.alice)
	require.Equal(t, http.StatusOK, status)
	fams = parse(t, body)
	_, ok = value(fams, "eitri_vm_cpu_seconds_total", f.alicesVM.Id)
	assert.True(t, ok)
	_, _, ok = portValue(fams, "eitri_published_port_bytes_total", f.alicesPort.Id, "in")
	assert.True(t, ok, "alice sees her own port")
	assert.NotContains(t, body, f.bobsVM.Id)
	assert.NotContains(t, body, f.bobsPort.Id)
	assert.NotContains(t, body, "bobs")
	assert.NotContains(t, body, "eitri_watchers", "the control plane's own figures are an admin's")

	// No token, or a bad one: nothing at all.
	for _, tok := range []string{"", "eitri_pat_nonsense"} {
		status, body = f.scrape(tok)
		assert.Equal(t, http.StatusUnauthorized, status)
		assert.NotContains(t, body, "eitri_vm")
	}

	// promtool holds the exposition to Prometheus' conventions.
	if promtool, err := exec.LookPath("promtool"); err == nil {
		_, body = f.scrape(f.admin)
		cmd := exec.Command(promtool, "check", "metrics")
		cmd.Stdin = strings.NewReader(body)
		out, err := cmd.CombinedOutput()
		assert.NoError(t, err, "promtool check metrics:\n%s", out)
	}
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// A real Prometheus (Debian's, see promtest) scrapes the control plane on
// loopback with alice's token; PromQL through its HTTP API sees her VM's CPU
// seconds grow, the bytes it sent and her published port's bytes, and none
// of bob's.
func TestARealPrometheusScrapesTheFleet(t *testing.T) {
	if _, err := exec.LookPath("prometheus"); err != nil {
		t.Skip("prometheus is not installed (Debian package prometheus)")
	}
	f := newFleet(t)
	f.sample(10, 1000)
	target, err := url.Parse(f.url)
	require.NoError(t, err)
	prom := promtest.Start(t, target, f.alice, time.Second)
	query := prom.Query

	cpu := fmt.Sprintf(`eitri_vm_cpu_seconds_total{vm=%q}`, f.alicesVM.Id)
	require.Eventually(t, func() bool { v, ok := query(cpu); return ok && v == 10 }, 60*time.Second, 200*time.Millisecond,
		"prometheus never saw the VM's CPU seconds; its log:\n%s", prom)

	f.sample(17.5, 5000)
	f.ports(1234, 5678)
	require.Eventually(t, func() bool { v, ok := query(cpu); return ok && v == 17.5 }, 30*time.Second, 200*time.Millisecond,
		"the CPU seconds never grew; prometheus' log:\n%s", prom)
	portIn := fmt.Sprintf(`eitri_published_port_bytes_total{exposure=%q,direction="in"}`, f.alicesPort.Id)
	require.Eventually(t, func() bool { v, ok := query(portIn); return ok && v == 1234 }, 30*time.Second, 200*time.Millisecond,
		"prometheus never saw the port's bytes; its log:\n%s", prom)
	_, ok := query(fmt.Sprintf(`eitri_published_port_sessions{exposure=%q}`, f.bobsPort.Id))
	assert.False(t, ok, "alice's token scrapes no port of bob's")
	v, ok := query(fmt.Sprintf(`eitri_vm_network_transmit_bytes_total{vm=%q}`, f.alicesVM.Id))
	require.True(t, ok)
	assert.Equal(t, float64(5000), v)
	_, ok = query(fmt.Sprintf(`eitri_vm_cpu_seconds_total{vm=%q}`, f.bobsVM.Id))
	assert.False(t, ok, "alice's token scrapes no VM of bob's")
}
