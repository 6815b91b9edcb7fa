package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store/pgtest"
)

// postgres is the PostgreSQL the replicas share: Debian's server binaries
// run by pgtest in a directory of its own under /tmp (as the postgres user
// when this runs as root), reachable over its unix socket only. pgtest
// trades durability for speed — fsync, full_page_writes and
// synchronous_commit off — which a benchmark whose data dies with it may
// do too; the control plane itself only turns synchronous_commit off for
// live writes.
type postgres struct {
	srv *pgtest.Server
	dsn string
	db  *sql.DB // the run's own queries: settings, counters, -dbprobe

	locks                              sync.Mutex
	lockSamples, lockWaiting, lockHeld int64 // -dbprobe's samples of pg_locks
}

// lockCounters are -dbprobe's pg_locks samples so far: how many, the
// sessions found waiting for an advisory lock summed over them, and in how
// many one was held.
func (p *postgres) lockCounters() [3]int64 {
	p.locks.Lock()
	defer p.locks.Unlock()
	return [3]int64{p.lockSamples, p.lockWaiting, p.lockHeld}
}

func startPostgres(ctx context.Context) (*postgres, error) {
	srv, err := pgtest.Start()
	if err != nil {
		return nil, err
	}
	name, err := srv.CreateDatabase(ctx, "")
	if err != nil {
		srv.Stop()
		return nil, err
	}
	dsn := srv.DSN(name)
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		srv.Stop()
		return nil, err
	}
	return &postgres{srv: srv, dsn: dsn, db: db}, nil
}

func (p *postgres) stop() {
	p.db.Close()
	if err := p.srv.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "stop postgres:", err)
	}
}

// settings are the server's settings that matter to a write-heavy run.
func (p *postgres) settings(ctx context.Context) string {
	var out []string
	for _, k := range []string{"fsync", "synchronous_commit", "full_page_writes", "shared_buffers", "max_connections"} {
		var v string
		if err := p.db.QueryRowContext(ctx, "SHOW "+k).Scan(&v); err != nil {
			return "?"
		}
		out = append(out, k+"="+v)
	}
	return strings.Join(out, " ")
}

// cpu is the CPU time (user+system) of the cluster's processes so far: the
// postmaster, its live children (backends, walwriter, checkpointer, …) and
// the children it has reaped (their time is in the postmaster's cutime and
// cstime), so a backend that ends between two readings is still counted.
// Other clusters on the machine (other tests' pgtest) are not.
func (p *postgres) cpu() time.Duration {
	b, err := os.ReadFile(filepath.Join(p.srv.Dir, "data", "postmaster.pid"))
	if err != nil {
		return 0
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pm, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return 0
	}
	f, ok := procStat(pm)
	if !ok {
		return 0
	}
	ticks := f.utime + f.stime + f.cutime + f.cstime
	procs, _ := os.ReadDir("/proc")
	for _, d := range procs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || pid == pm {
			continue
		}
		if c, ok := procStat(pid); ok && c.ppid == pm {
			ticks += c.utime + c.stime
		}
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}

type statFields struct {
	ppid                         int
	utime, stime, cutime, cstime int64
}

// procStat reads /proc/PID/stat: after the command name (which may hold
// spaces), ppid is the 4th field of the line, utime to cstime the 14th to
// 17th.
func procStat(pid int) (statFields, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return statFields{}, false
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || i+2 > len(b) {
		return statFields{}, false
	}
	f := strings.Fields(string(b[i+2:]))
	if len(f) < 15 {
		return statFields{}, false
	}
	n := func(s string) int64 { v, _ := strconv.ParseInt(s, 10, 64); return v }
	return statFields{ppid: int(n(f[1])), utime: n(f[11]), stime: n(f[12]), cutime: n(f[13]), cstime: n(f[14])}, true
}

// probe reads host_live as a follower would, every 10 ms, and records when
// each change first shows in the database: the agent → home replica →
// PostgreSQL half of the way to a watcher on another replica (-dbprobe).
func (p *postgres) probe(ctx context.Context, tr *tracks) *watcher {
	w := &watcher{replica: -1, seen: map[string]uint64{}}
	// How many sessions wait for an advisory lock (the live writes' and the
	// change feed's, which keep revisions in commit order) and whether one
	// is held, sampled every 20 ms.
	go every(ctx, 20*time.Millisecond, func() {
		var waiting, held int64
		if p.db.QueryRowContext(ctx, `SELECT
			(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted),
			(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted)`).Scan(&waiting, &held) != nil {
			return
		}
		p.locks.Lock()
		p.lockSamples++
		p.lockWaiting += waiting
		if held > 0 {
			p.lockHeld++
		}
		p.locks.Unlock()
	})
	var after int64
	go every(ctx, 10*time.Millisecond, func() {
		rows, err := p.db.QueryContext(ctx, `SELECT report, rev FROM host_live WHERE rev > $1 AND report IS NOT NULL ORDER BY rev`, after)
		if err != nil {
			return
		}
		defer rows.Close()
		now := time.Now()
		for rows.Next() {
			var b []byte
			if err := rows.Scan(&b, &after); err != nil {
				return
			}
			rep := &eitriv1.ActualStateReport{}
			if proto.Unmarshal(b, rep) != nil {
				continue
			}
			for _, v := range rep.GetVms() {
				if seq, ok := seqOf(v.GetStatusDetail()); ok {
					w.saw(tr, v.GetVmId(), seq, now)
				}
			}
			for _, e := range rep.GetExposures() {
				w.saw(tr, e.GetId(), uint64(e.GetSessions().GetActive()), now)
			}
		}
	})
	return w
}

// every runs fn every d until ctx ends.
func every(ctx context.Context, d time.Duration, fn func()) {
	tick := time.NewTicker(d)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			fn()
		}
	}
}

// dbStats are the database's counters that say how its transactions
// fared: a rollback is, in this run, almost always a serialization
// failure the store retries.
type dbStats struct {
	commits, rollbacks int64
	logAt              int64 // size of postgres.log
	rev                int64 // the change feed's newest revision
}

func (p *postgres) stats(ctx context.Context) dbStats {
	var st dbStats
	_ = p.db.QueryRowContext(ctx, `SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = current_database()`).
		Scan(&st.commits, &st.rollbacks)
	_ = p.db.QueryRowContext(ctx, `SELECT coalesce(max(rev), 0) FROM changes`).Scan(&st.rev)
	if fi, err := os.Stat(filepath.Join(p.srv.Dir, "postgres.log")); err == nil {
		st.logAt = fi.Size()
	}
	return st
}

// logErrors counts the ERROR lines postgres.log gained after offset, by
// message (the first few kinds).
func (p *postgres) logErrors(offset int64) string {
	f, err := os.Open(filepath.Join(p.srv.Dir, "postgres.log"))
	if err != nil {
		return "?"
	}
	defer f.Close()
	if _, err := f.Seek(offset, 0); err != nil {
		return "?"
	}
	b, _ := io.ReadAll(io.LimitReader(f, 64<<20))
	n := map[string]int{}
	var kinds []string
	for line := range strings.Lines(string(b)) {
		_, msg, ok := strings.Cut(line, "ERROR:  ")
		if !ok {
			continue
		}
		msg = strings.TrimSpace(msg)
		if n[msg] == 0 {
			kinds = append(kinds, msg)
		}
		n[msg]++
	}
	if len(kinds) == 0 {
		return "none"
	}
	var out []string
	for _, k := range kinds[:min(len(kinds), 3)] {
		out = append(out, fmt.Sprintf("%d× %q", n[k], k))
	}
	return strings.Join(out, ", ")
}

// feed says what the change feed (durable writes other replicas follow)
// gained in (after, upto], by kind.
func (p *postgres) feed(ctx context.Context, after, upto int64) string {
	rows, err := p.db.QueryContext(ctx, `SELECT kind, count(*) FROM changes WHERE rev > $1 AND rev <= $2 GROUP BY kind ORDER BY kind`, after, upto)
	if err != nil {
		return "?"
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var k string
		var n int64
		if rows.Scan(&k, &n) == nil {
			out = append(out, fmt.Sprintf("%s %d", k, n))
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}
