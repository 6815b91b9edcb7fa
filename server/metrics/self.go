package metrics

import (
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/a73x/eitri/server/store"
)

// Self is the control plane's own figures: the API calls it served, the
// streams it holds open, its agents' Sync streams and how quickly their
// reports are applied, and how long its store takes. It is fed as things
// happen (unlike the fleet, read at scrape time) and served to an admin's
// scrape only.
//
// Labels come from fixed sets: procedure names the caller has checked
// against the generated ones (anything else arrives as "other"), Connect
// codes, store operations.
type Self struct {
	requests  *prometheus.CounterVec
	duration  *prometheus.HistogramVec
	streams   *prometheus.GaugeVec
	sync      prometheus.Gauge
	reportLag prometheus.Histogram
	store     *prometheus.HistogramVec
	storeOps  map[store.Op]prometheus.Observer
	// procs holds each procedure's series once used (*procFigures by
	// name), so a call costs a map load and atomic adds rather than
	// hashing its labels into the vectors.
	procs sync.Map
}

// procFigures is one procedure's series: its histogram, and its counter
// per code (index 0 for "ok"), each made on first use.
type procFigures struct {
	duration prometheus.Observer
	codes    [connect.CodeUnauthenticated + 1]atomic.Pointer[prometheus.Counter]
}

func (s *Self) figures(procedure string) *procFigures {
	if f, ok := s.procs.Load(procedure); ok {
		return f.(*procFigures)
	}
	f, _ := s.procs.LoadOrStore(procedure, &procFigures{duration: s.duration.WithLabelValues(procedure)})
	return f.(*procFigures)
}

func (s *Self) count(procedure string, code connect.Code) {
	f := s.figures(procedure)
	c := f.codes[code].Load()
	if c == nil {
		name := "ok"
		if code != 0 {
			name = code.String()
		}
		made := s.requests.WithLabelValues(procedure, name)
		c = &made
		f.codes[code].Store(c)
	}
	(*c).Inc()
}

// Buckets from half a millisecond (a cached read) to ten seconds (a call
// waiting on a slow database).
var latencyBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}

// NewSelf makes the figures, all at zero.
func NewSelf() *Self {
	s := &Self{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "eitri_requests_total",
			Help: "API calls this control plane finished (unary and streams), by procedure and Connect code; calls refused before a handler ran (no credential) included. Procedures it does not serve are \"other\".",
		}, []string{"procedure", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "eitri_request_duration_seconds",
			Help:    "How long unary API calls took in their handler (after authentication by the HTTP layer), by procedure.",
			Buckets: latencyBuckets,
		}, []string{"procedure"}),
		streams: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "eitri_streams_open",
			Help: "Streaming API calls open on this control plane, by procedure.",
		}, []string{"procedure"}),
		sync: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "eitri_sync_streams",
			Help: "Agents' Sync streams open on this control plane that said hello and hold their host's session.",
		}),
		reportLag: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "eitri_sync_report_lag_seconds",
			Help:    "From this control plane reading an agent's state report off its Sync stream to having applied it (stored and published to watchers), queueing behind earlier reports included. Time on the wire is not: reports carry no send time.",
			Buckets: latencyBuckets,
		}),
		store: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "eitri_store_operation_duration_seconds",
			Help:    "How long the store took, by operation: query (a read outside a transaction, to its first rows), exec (a statement outside one), transaction (BEGIN to COMMIT or ROLLBACK, each attempt), write_wait (SQLite: waiting for the one writer's slot).",
			Buckets: latencyBuckets,
		}, []string{"operation"}),
		storeOps: map[store.Op]prometheus.Observer{},
	}
	for _, op := range store.Ops {
		s.storeOps[op] = s.store.WithLabelValues(string(op))
	}
	return s
}

// Describe sends every figure's description.
func (s *Self) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range s.collectors() {
		c.Describe(ch)
	}
}

// Collect sends every figure.
func (s *Self) Collect(ch chan<- prometheus.Metric) {
	for _, c := range s.collectors() {
		c.Collect(ch)
	}
}

func (s *Self) collectors() []prometheus.Collector {
	return []prometheus.Collector{s.requests, s.duration, s.streams, s.sync, s.reportLag, s.store}
}

// Finished counts one call to procedure ending with err (nil is "ok"); a
// unary call's duration goes into the histogram too.
func (s *Self) Finished(procedure string, unary bool, err error, d time.Duration) {
	s.count(procedure, codeOf(err))
	if unary {
		s.figures(procedure).duration.Observe(d.Seconds())
	}
}

// Refused counts a call refused before any handler ran.
func (s *Self) Refused(procedure string, code connect.Code) {
	s.count(procedure, known(code))
}

// StreamOpened and StreamClosed bracket a streaming call.
func (s *Self) StreamOpened(procedure string) { s.streams.WithLabelValues(procedure).Inc() }
func (s *Self) StreamClosed(procedure string) { s.streams.WithLabelValues(procedure).Dec() }

// SyncOpened and SyncClosed bracket an agent's Sync session.
func (s *Self) SyncOpened() { s.sync.Inc() }
func (s *Self) SyncClosed() { s.sync.Dec() }

// ReportApplied records how long a report took from being read to being
// applied.
func (s *Self) ReportApplied(lag time.Duration) { s.reportLag.Observe(lag.Seconds()) }

// ObserveStore implements store.Observer.
func (s *Self) ObserveStore(op store.Op, d time.Duration) {
	if o, ok := s.storeOps[op]; ok {
		o.Observe(d.Seconds())
	}
}

// codeOf is err's code, 0 for success.
func codeOf(err error) connect.Code {
	if err == nil {
		return 0
	}
	return known(connect.CodeOf(err))
}

// known keeps the label to Connect's codes, whatever the error held.
func known(c connect.Code) connect.Code {
	if c < connect.CodeCanceled || c > connect.CodeUnauthenticated {
		return connect.CodeUnknown
	}
	return c
}
