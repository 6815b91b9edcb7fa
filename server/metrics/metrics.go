// Package metrics serves the fleet to Prometheus: one scrape target for
// every host and VM, read from the control plane's current state at scrape
// time (the VMs and hosts as the caller may see them, and each one's newest
// usage sample). Built on prometheus/client_golang, whose collectors and
// exposition are what every Prometheus-compatible scraper reads.
package metrics

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/usage"
)

// Fleet is what a scrape reads: the VMs, hosts and published ports the
// caller (on ctx) may see, as ListVMs, ListHosts and ListExposures serve
// them (an empty vmID lists every port the caller can see).
type Fleet interface {
	ListVMs(ctx context.Context) ([]*eitriv1.VM, error)
	ListHosts(ctx context.Context) ([]*eitriv1.Host, error)
	ListExposures(ctx context.Context, vmID string) ([]*eitriv1.Exposure, error)
}

// Usage is the newest sample of each VM and host.
type Usage interface {
	Latest() ([]usage.VMLatest, []*eitriv1.HostUsage)
}

// Fresh is how old a sample may be and still be served: a VM that stopped
// (or a host that went away) drops out of the scrape within it rather than
// repeating its last counters for the hour its window is kept.
const Fresh = time.Minute

// Handler serves the exposition. The caller is authenticated before it (the
// principal rides on the request's context); what it may not see through
// the API it does not see here either.
//
// watchers counts the control plane's open watch streams by what they
// watch ("vms", "hosts", ...); they and self (the control plane's own
// figures, nil for none) are only in an admin's scrape.
func Handler(f Fleet, u Usage, watchers func() map[string]int, self *Self, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reg := prometheus.NewRegistry()
		// A registry per scrape: what it holds depends on who asks.
		reg.MustRegister(&collector{ctx: r.Context(), fleet: f, usage: u, watchers: watchers, now: time.Now(), log: log})
		if p, ok := auth.FromContext(r.Context()); ok && p.Admin && self != nil {
			reg.MustRegister(self)
		}
		promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}).ServeHTTP(w, r)
	})
}
