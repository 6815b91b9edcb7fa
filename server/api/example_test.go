package api_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"time"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
)

// These examples use the generated Go clients the way a program does
// against `eitri server`: a base URL, an *http.Client that trusts the
// server's certificate, and a token (the admin's, from admin.token, or one
// made with `eitri token create`). go test runs them and checks their
// output against a real control plane.

// Example_createVM creates a VM with the generated VMService client over the
// Connect protocol, and shows how a refused request reads.
func Example_createVM() {
	baseURL, httpClient, token, stop := exampleServer()
	defer stop()
	ctx := context.Background()

	vms := eitriv1connect.NewVMServiceClient(httpClient, baseURL)

	req := connect.NewRequest(&eitriv1.CreateVMRequest{
		Name:        "web-1",
		ImageUrl:    "https://images.example.com/debian-12.raw",
		ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
		Vcpus:       1,
		MemMb:       512,
		DiskGb:      4,
	})
	req.Header().Set("Authorization", "Bearer "+token)
	res, err := vms.CreateVM(ctx, req)
	if err != nil {
		fmt.Println("create:", err)
		return
	}
	vm := res.Msg.GetVm()
	fmt.Println(vm.GetName(), vm.GetPowerState(), vm.GetVcpus(), vm.GetMemMb(), vm.GetDiskGb())

	// Refusals are Connect errors with a code and a message naming the field.
	bad := connect.NewRequest(&eitriv1.CreateVMRequest{Name: "Web_1"})
	bad.Header().Set("Authorization", "Bearer "+token)
	_, err = vms.CreateVM(ctx, bad)
	var ce *connect.Error
	if errors.As(err, &ce) {
		fmt.Println(ce.Code(), ce.Message())
	}
	// Output:
	// web-1 running 1 512 4
	// invalid_argument name: "Web_1" is not a DNS label (lowercase letters, digits and '-', 1-63 characters, no leading or trailing '-')
}

// Example_watchVMs follows WatchVMs, over gRPC this time (connect.WithGRPC;
// the Connect protocol is the default and works the same): the snapshot
// first, then every VM whole as it changes, here one created meanwhile.
func Example_watchVMs() {
	baseURL, httpClient, token, stop := exampleServer()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel() // ends the stream

	vms := eitriv1connect.NewVMServiceClient(httpClient, baseURL, connect.WithGRPC())

	watch := connect.NewRequest(&eitriv1.WatchVMsRequest{})
	watch.Header().Set("Authorization", "Bearer "+token)
	stream, err := vms.WatchVMs(ctx, watch)
	if err != nil {
		fmt.Println("watch:", err)
		return
	}
	defer stream.Close()

	created := false
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().(type) {
		case *eitriv1.WatchVMsResponse_Snapshot:
			fmt.Println("snapshot:", len(ev.Snapshot.GetVms()), "VMs")
		case *eitriv1.WatchVMsResponse_Changed:
			fmt.Println("changed:", ev.Changed.GetName(), ev.Changed.GetPowerState())
			return
		case *eitriv1.WatchVMsResponse_RemovedId:
			fmt.Println("removed:", ev.RemovedId)
		}
		if !created {
			created = true
			req := connect.NewRequest(&eitriv1.CreateVMRequest{
				Name: "db-1", ImageUrl: "https://images.example.com/debian-12.raw",
				ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
				Vcpus:       2, MemMb: 1024, DiskGb: 10, PowerState: "stopped",
			})
			req.Header().Set("Authorization", "Bearer "+token)
			if _, err := vms.CreateVM(ctx, req); err != nil {
				fmt.Println("create:", err)
				return
			}
		}
	}
	fmt.Println("stream ended:", stream.Err())
	// Output:
	// snapshot: 0 VMs
	// changed: db-1 stopped
}

// exampleServer starts a control plane on an httptest server (HTTP/2 over
// TLS) with one host, so a create has somewhere to go. The host speaks the
// agent protocol with the generated AgentService client (enroll, hello, a
// capacity report) and never boots anything: the examples are about the
// API. It returns the base URL, a client trusting the server's certificate,
// the admin token and a stop func.
func exampleServer() (baseURL string, httpClient *http.Client, token string, stop func()) {
	dir, err := os.MkdirTemp("", "eitri-example-")
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s, err := server.New(ctx, server.Config{DataDir: dir, Plaintext: true, DeleteGrace: time.Hour, Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		panic(err)
	}
	ts := httptest.NewUnstartedServer(s.Handler())
	ts.EnableHTTP2 = true
	ts.StartTLS()
	var closeHost func()
	stop = func() {
		if closeHost != nil {
			closeHost()
		}
		cancel()
		ts.Close()
		s.Close()
		os.RemoveAll(dir)
	}
	if closeHost, err = exampleHost(ctx, ts.URL, ts.Client(), s.AdminToken); err != nil {
		stop()
		panic(err)
	}
	return ts.URL, ts.Client(), s.AdminToken, stop
}

// exampleHost enrolls a host, connects it and returns once the control
// plane lists it connected with its capacity, with the func that hangs up.
// (Cancelling ctx alone does not end a bidi stream whose request body is
// still open; closing the request does.)
func exampleHost(ctx context.Context, baseURL string, hc *http.Client, admin string) (hangUp func(), err error) {
	hosts := eitriv1connect.NewHostServiceClient(hc, baseURL, bearer(admin))
	jt, err := hosts.CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
	if err != nil {
		return nil, err
	}
	agents := eitriv1connect.NewAgentServiceClient(hc, baseURL)
	en, err := agents.Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: jt.Msg.GetToken(), Hostname: "host-1"}))
	if err != nil {
		return nil, err
	}
	sync := eitriv1connect.NewAgentServiceClient(hc, baseURL, bearer(en.Msg.GetHostCredential())).Sync(ctx)
	hangUp = func() { _ = sync.CloseRequest() }
	hello := &eitriv1.Hello{HostId: en.Msg.GetHostId(), AgentVersion: "example", Accelerator: "tcg"}
	if err := sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Hello{Hello: hello}}); err != nil {
		return hangUp, err
	}
	if _, err := sync.Receive(); err != nil { // the first desired state
		return hangUp, err
	}
	capacity := &eitriv1.Capacity{Vcpus: 8, MemMb: 16384, DiskGb: 200}
	report := &eitriv1.ActualStateReport{Capacity: capacity}
	if err := sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Report{Report: report}}); err != nil {
		return hangUp, err
	}
	go func() { // desired states keep coming; this host only reads them
		for {
			if _, err := sync.Receive(); err != nil {
				return
			}
		}
	}()
	// The report lands asynchronously; wait for it by watching the host.
	watch, err := hosts.WatchHosts(ctx, connect.NewRequest(&eitriv1.WatchHostsRequest{}))
	if err != nil {
		return hangUp, err
	}
	defer watch.Close()
	for watch.Receive() {
		var seen []*eitriv1.Host
		switch ev := watch.Msg().GetEvent().(type) {
		case *eitriv1.WatchHostsResponse_Snapshot:
			seen = ev.Snapshot.GetHosts()
		case *eitriv1.WatchHostsResponse_Changed:
			seen = []*eitriv1.Host{ev.Changed}
		}
		for _, h := range seen {
			if h.GetId() == en.Msg.GetHostId() && h.GetConnected() && h.GetCapacity() != nil {
				return hangUp, nil
			}
		}
	}
	return hangUp, fmt.Errorf("watching hosts: %w", watch.Err())
}
