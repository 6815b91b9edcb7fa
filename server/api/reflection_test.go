package api_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpcreflect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/api"
)

// reflect opens a reflection stream the way grpcurl does: gRPC, no
// credential.
func (e *env) reflect(t *testing.T) *grpcreflect.ClientStream {
	t.Helper()
	st := grpcreflect.NewClient(e.http, e.url, connect.WithGRPC()).NewStream(context.Background())
	t.Cleanup(func() { _, _ = st.Close() })
	return st
}

func TestReflectionListsTheUserServicesToAnyone(t *testing.T) {
	e := newEnv(t)
	st := e.reflect(t)
	names, err := st.ListServices()
	require.NoError(t, err)
	got := make([]string, len(names))
	for i, n := range names {
		got[i] = string(n)
	}
	assert.ElementsMatch(t, api.UserServices, got, "the user-facing services, not the agent's")
}

// A call by reflection: the schema comes from the server, the request from
// JSON, nothing from proto/.
func TestACallByReflectionNeedsNoProtoFiles(t *testing.T) {
	e := newEnv(t)
	st := e.reflect(t)
	fdps, err := st.FileContainingSymbol("eitri.v1.TokenService")
	require.NoError(t, err)
	files, err := protodesc.NewFiles(&descriptorpb.FileDescriptorSet{File: fdps})
	require.NoError(t, err)
	d, err := files.FindDescriptorByName("eitri.v1.TokenService.CreateToken")
	require.NoError(t, err)
	method := d.(protoreflect.MethodDescriptor)

	req := dynamicpb.NewMessage(method.Input())
	require.NoError(t, protojson.Unmarshal([]byte(`{"name":"by-reflection","ttl":"3600s"}`), req))
	client := connect.NewClient[dynamicpb.Message, dynamicpb.Message](e.http, e.url+"/eitri.v1.TokenService/CreateToken",
		connect.WithGRPC(), connect.WithSchema(method), bearer(e.admin),
		connect.WithResponseInitializer(func(_ connect.Spec, msg any) error {
			*msg.(*dynamicpb.Message) = *dynamicpb.NewMessage(method.Output())
			return nil
		}))
	resp, err := client.CallUnary(context.Background(), connect.NewRequest(req))
	require.NoError(t, err)
	out, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(resp.Msg)
	require.NoError(t, err)
	assert.Contains(t, string(out), `"name":"by-reflection"`)
	assert.Contains(t, string(out), `"secret":"eitri_pat_`)
}

func TestAnOversizedReflectionRequestIsRefused(t *testing.T) {
	e := newEnv(t)
	st := e.reflect(t)
	_, err := st.FileByFilename(strings.Repeat("a", api.MaxReflectionMessage+1))
	assert.Equal(t, connect.CodeResourceExhausted, code(err))
}

// bufCLI is the buf CLI `make deps` installs from npm.
func bufCLI(t *testing.T) string {
	t.Helper()
	p, err := filepath.Abs("../../node_modules/.bin/buf")
	require.NoError(t, err)
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("buf CLI not installed (run make deps): %v", err)
	}
	return p
}

// buf curl --reflect is a client nobody here wrote: it lists and calls
// every protocol, over either reflection version.
func TestBufCurlListsAndCallsByReflection(t *testing.T) {
	e := newEnv(t)
	buf := bufCLI(t)
	run := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(buf, append([]string{"curl", "--insecure"}, args...)...).CombinedOutput()
		require.NoError(t, err, "buf curl %v:\n%s", args, out)
		return string(out)
	}
	for _, rp := range []string{"grpc-v1", "grpc-v1alpha"} {
		list := strings.Fields(run("--reflect", "--reflect-protocol", rp, "--list-services", e.url))
		slices.Sort(list)
		want := slices.Clone(api.UserServices)
		slices.Sort(want)
		assert.Equal(t, want, list, rp)
		for _, p := range []string{"connect", "grpc", "grpcweb"} {
			out := run("--reflect", "--reflect-protocol", rp, "--protocol", p,
				"-H", "Authorization: Bearer "+e.admin, "-d", `{"name":"curl-`+p+`"}`,
				e.url+"/eitri.v1.TokenService/CreateToken")
			assert.Contains(t, out, `"name": "curl-`+p+`"`, "%s over %s", p, rp)
		}
	}
}

// An open stream is bounded as a whole too: a caller with no credential
// gets the schema, not a channel that costs the server without end.
func TestAReflectionStreamIsBoundedAsAWhole(t *testing.T) {
	e := newEnv(t)
	st := e.reflect(t)
	name := strings.Repeat("a", api.MaxReflectionMessage-64)
	var err error
	sent := 0
	for ; sent < 2*server.MaxOpenBody/len(name) && err == nil; sent++ {
		_, err = st.FileByFilename(name)
		if connect.CodeOf(err) == connect.CodeNotFound {
			err = nil // a fine answer: no such file
		}
	}
	require.Error(t, err)
	assert.Equal(t, connect.CodeResourceExhausted, code(err))
	assert.LessOrEqual(t, sent*len(name), server.MaxOpenBody+len(name), "cut off at the limit")
}

// A reflection stream left open is cut off once the body timeout passes,
// like any unauthenticated body.
func TestAnIdleReflectionStreamIsCutOff(t *testing.T) {
	s := serve(t, server.Config{BodyTimeout: 100 * time.Millisecond})
	st := s.reflect(t)
	_, err := st.ListServices()
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, err = st.ListServices()
		return err != nil
	}, 10*time.Second, 20*time.Millisecond)
	assert.True(t, grpcreflect.IsReflectionStreamBroken(err), "%v", err)
	assert.Equal(t, connect.CodeDeadlineExceeded, code(err))
}
