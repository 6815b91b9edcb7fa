package metrics_test

import (
	"context"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// labelled is the metric of family name whose labels include all of want.
func labelled(fams map[string]*dto.MetricFamily, name string, want map[string]string) *dto.Metric {
	for _, m := range fams[name].GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		match := true
		for k, v := range want {
			match = match && have[k] == v
		}
		if match {
			return m
		}
	}
	return nil
}

func requests(fams map[string]*dto.MetricFamily, procedure, code string) float64 {
	return labelled(fams, "eitri_requests_total", map[string]string{"procedure": procedure, "code": code}).GetCounter().GetValue()
}

func TestTheControlPlaneCountsItsOwnCallsStreamsAndStore(t *testing.T) {
	f := newFleet(t)
	ctx := context.Background()

	// Refused in the handler: alice is no admin.
	_, err := eitriv1connect.NewHostServiceClient(f.http, f.url, bearer(f.alice)).CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
	require.Equal(t, connect.CodePermissionDenied, connect.CodeOf(err))
	// Refused before any handler: no credential.
	_, err = eitriv1connect.NewVMServiceClient(f.http, f.url).ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.Equal(t, connect.CodeUnauthenticated, connect.CodeOf(err))
	// A path that names no procedure, twice with different names: one
	// series, "other".
	for _, name := range []string{"Nope", "AlsoNope"} {
		req, err := http.NewRequest(http.MethodPost, f.url+"/eitri.v1.VMService/"+name, strings.NewReader("{}"))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+f.admin)
		req.Header.Set("Content-Type", "application/json")
		resp, err := f.http.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusNotFound, resp.StatusCode)
	}

	watch, err := eitriv1connect.NewUsageServiceClient(f.http, f.url, bearer(f.admin)).WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{}))
	require.NoError(t, err)
	require.True(t, watch.Receive())

	// newFleet's two reports are applied (the VM shows running) a moment
	// before their lag is recorded.
	var fams map[string]*dto.MetricFamily
	require.Eventually(t, func() bool {
		status, body := f.scrape(f.admin)
		require.Equal(t, http.StatusOK, status)
		fams = parse(t, body)
		return fams["eitri_sync_report_lag_seconds"].GetMetric()[0].GetHistogram().GetSampleCount() >= 2
	}, 10*time.Second, 10*time.Millisecond, "both reports' lag is recorded")

	assert.Equal(t, dto.MetricType_COUNTER, fams["eitri_requests_total"].GetType())
	assert.Equal(t, 2.0, requests(fams, eitriv1connect.VMServiceCreateVMProcedure, "ok"), "two VMs were created")
	assert.Equal(t, 1.0, requests(fams, eitriv1connect.HostServiceCreateJoinTokenProcedure, "ok"))
	assert.Equal(t, 1.0, requests(fams, eitriv1connect.HostServiceCreateJoinTokenProcedure, "permission_denied"))
	assert.Equal(t, 1.0, requests(fams, eitriv1connect.VMServiceListVMsProcedure, "unauthenticated"))
	assert.Equal(t, 2.0, requests(fams, "other", "unimplemented"))
	assert.NotContains(t, labelValues(fams, "eitri_requests_total", "procedure"), "/eitri.v1.VMService/Nope")

	created := labelled(fams, "eitri_request_duration_seconds", map[string]string{"procedure": eitriv1connect.VMServiceCreateVMProcedure})
	require.NotNil(t, created, "unary calls are timed")
	h := created.GetHistogram()
	assert.Equal(t, uint64(2), h.GetSampleCount())
	assert.Positive(t, h.GetSampleSum())
	var bounds []float64
	for _, b := range h.GetBucket() {
		bounds = append(bounds, b.GetUpperBound())
	}
	assert.Contains(t, bounds, 0.001)
	assert.Contains(t, bounds, 10.0)
	assert.Nil(t, labelled(fams, "eitri_request_duration_seconds", map[string]string{"procedure": eitriv1connect.UsageServiceWatchUsageProcedure}),
		"streams are not in the unary histogram")

	open := func(procedure string) float64 {
		return labelled(fams, "eitri_streams_open", map[string]string{"procedure": procedure}).GetGauge().GetValue()
	}
	assert.Equal(t, 1.0, open(eitriv1connect.UsageServiceWatchUsageProcedure))
	assert.Equal(t, 1.0, open(eitriv1connect.AgentServiceSyncProcedure))
	assert.Equal(t, 1.0, fams["eitri_sync_streams"].GetMetric()[0].GetGauge().GetValue())

	for _, op := range []string{"query", "transaction", "write_wait"} {
		m := labelled(fams, "eitri_store_operation_duration_seconds", map[string]string{"operation": op})
		require.NotNil(t, m, op)
		assert.Positive(t, m.GetHistogram().GetSampleCount(), "the store timed its %s", op)
	}

	// A stream that ends is no longer open, and counts as a call.
	require.NoError(t, watch.Close())
	require.Eventually(t, func() bool {
		_, body := f.scrape(f.admin)
		fams = parse(t, body)
		return open(eitriv1connect.UsageServiceWatchUsageProcedure) == 0
	}, 10*time.Second, 10*time.Millisecond)
	ended := 0.0 // whatever its code: the client hung up
	for _, m := range fams["eitri_requests_total"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "procedure" && l.GetValue() == eitriv1connect.UsageServiceWatchUsageProcedure {
				ended += m.GetCounter().GetValue()
			}
		}
	}
	assert.Equal(t, 1.0, ended)

	// The control plane's own figures are an admin's.
	_, body := f.scrape(f.alice)
	assert.NotContains(t, body, "eitri_requests_total")
	assert.NotContains(t, body, "eitri_store_")

	// promtool holds the exposition to Prometheus' conventions. make test
	// installs it (Debian's prometheus package); its absence is a failure.
	promtool, err := exec.LookPath("promtool")
	require.NoError(t, err, "promtool is needed: apt-get install prometheus (make deps installs it)")
	_, body = f.scrape(f.admin)
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(body)
	out, err := cmd.CombinedOutput()
	assert.NoError(t, err, "promtool check metrics:\n%s", out)
}

func labelValues(fams map[string]*dto.MetricFamily, name, label string) []string {
	var out []string
	for _, m := range fams[name].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == label {
				out = append(out, l.GetValue())
			}
		}
	}
	return out
}
