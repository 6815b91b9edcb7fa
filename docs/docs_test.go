// Package docs_test runs the documentation: every ```sh block of the files
// it covers is executed with bash against a real control plane on loopback,
// in order, as a reader pasting them into one terminal would (variables and
// functions one block defines are there in the next). A block must exit 0;
// where the doc shows its output (a ```json or ```text block right after
// it) the output must match that in substance:
//
//   - json: every key the doc shows is there with the value shown (the API
//     sends more: every field, always); "…" in a string stands for anything,
//     so "vm-…" is any id starting vm-. Several values (a stream's messages,
//     one per line) must appear in that order, others may come between.
//   - text: every line shown appears, in order, "…" again standing for
//     anything.
//
// A block that runs until it is stopped (a watch) is preceded by
// <!-- doctest: interrupt 2s -->: it is sent SIGINT after that long, as a
// reader would press Ctrl-C, and must not have ended by itself before.
package docs_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/wire/connclient"
)

// block is one fenced code block.
type block struct {
	line      int // of its opening fence, 1-based
	lang      string
	text      string
	directive string // the <!-- doctest: … --> right before it
	output    *block // the output block shown right after it
}

var (
	fence     = regexp.MustCompile("^```\\s*([A-Za-z0-9_+-]*)")
	directive = regexp.MustCompile(`^<!--\s*doctest:\s*(.*?)\s*-->$`)
)

// parse returns the blocks of a markdown file, output blocks attached to
// the block they show the output of.
func parse(md string) []*block {
	var out []*block
	lines := strings.Split(md, "\n")
	var prev *block  // the last code block
	sinceBlank := -1 // lines since prev closed that were not blank
	lastDirective := ""
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		m := fence.FindStringSubmatch(l)
		if m == nil {
			if d := directive.FindStringSubmatch(strings.TrimSpace(l)); d != nil {
				lastDirective = d[1]
			} else if strings.TrimSpace(l) != "" {
				lastDirective = ""
				sinceBlank++
			}
			continue
		}
		b := &block{line: i + 1, lang: m[1], directive: lastDirective}
		lastDirective = ""
		var body []string
		for i++; i < len(lines) && !strings.HasPrefix(lines[i], "```"); i++ {
			body = append(body, lines[i])
		}
		b.text = strings.Join(body, "\n") + "\n"
		if prev != nil && prev.lang == "sh" && sinceBlank == 0 && (b.lang == "json" || b.lang == "text") {
			prev.output = b
		} else {
			out = append(out, b)
		}
		prev, sinceBlank = b, 0
	}
	return out
}

// controlPlane is a real control plane on loopback (plain h2c, as eitri
// dev serves) with one connected host that does what it is told: it reports
// every VM it is given as running (or stopped) with an address, and every
// published port as active. It speaks the real AgentService protocol; only
// QEMU is left out, so the docs run in seconds on any machine.
func controlPlane(t *testing.T) (url, token string) {
	t.Helper()
	dir := t.TempDir()
	srv, err := server.New(context.Background(), server.Config{DataDir: dir, Plaintext: true, DeleteGrace: time.Hour,
		Log: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	// eitri dev lists its test guest under this name, and the quickstart
	// creates by it; the obliging host below boots anything, so any digest
	// will do.
	require.NoError(t, srv.Fleet.PutImage(context.Background(), "test-guest", "http://images.example/eitri-guest.raw",
		strings.Repeat("ab", 32), &eitriv1.ImageProperties{MinMemMb: 128, MinDiskGb: 1}, "docs"))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ctx, ln) }()
	t.Cleanup(func() { cancel(); <-done; srv.Close() })
	url = "http://" + ln.Addr().String()
	h2 := &http.Transport{Protocols: new(http.Protocols)}
	h2.Protocols.SetUnencryptedHTTP2(true)
	hc := &http.Client{Transport: h2}
	host(t, ctx, hc, url, srv.AdminToken)
	return url, srv.AdminToken
}

// host enrolls and connects the obliging host, and waits until it is
// listed as connected with its capacity.
func host(t *testing.T, ctx context.Context, hc *http.Client, url, admin string) {
	t.Helper()
	hosts := eitriv1connect.NewHostServiceClient(hc, url, connect.WithInterceptors(connclient.Bearer(admin)))
	jt, err := hosts.CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
	require.NoError(t, err)
	agent := eitriv1connect.NewAgentServiceClient(hc, url)
	en, err := agent.Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: jt.Msg.Token, Hostname: "host-1"}))
	require.NoError(t, err)
	sync := eitriv1connect.NewAgentServiceClient(hc, url, connect.WithInterceptors(connclient.Bearer(en.Msg.HostCredential))).Sync(ctx)
	require.NoError(t, sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Hello{Hello: &eitriv1.Hello{
		AgentVersion: "docs", Address: "127.0.0.1", Accelerator: "tcg", AcceleratorReason: "no KVM here"}}}))
	capacity := &eitriv1.Capacity{Vcpus: 8, MemMb: 16384, DiskGb: 200}
	go func() {
		ips := map[string]string{}
		for {
			msg, err := sync.Receive()
			if err != nil {
				return
			}
			snap := msg.GetSnapshot()
			rep := &eitriv1.ActualStateReport{Capacity: capacity, AppliedGeneration: snap.GetGeneration(),
				AppliedEpoch: snap.GetEpoch(), ControlPlaneId: snap.GetControlPlaneId(), Accelerator: "tcg"}
			for _, vm := range snap.GetVms() {
				if vm.Destroy {
					rep.Destroyed = append(rep.Destroyed, vm.VmId)
					continue
				}
				if ips[vm.VmId] == "" {
					ips[vm.VmId] = fmt.Sprintf("10.77.0.%d", len(ips)+2)
				}
				power := vm.PowerState
				if vm.Deleted {
					power = "stopped"
				}
				rep.Vms = append(rep.Vms, &eitriv1.ActualVM{VmId: vm.VmId, Power: power, Phase: "ready", Ip: ips[vm.VmId],
					SshHostPubkey: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDocsDocsDocsDocsDocsDocsDocsDocsDocsDocsDocs", LoginUser: "eitri"})
			}
			for _, x := range snap.GetExposures() {
				rep.Exposures = append(rep.Exposures, &eitriv1.ExposureActual{Id: x.Id, State: "active"})
			}
			if sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Report{Report: rep}}) != nil {
				return
			}
		}
	}()
	require.Eventually(t, func() bool {
		h, err := hosts.GetHost(ctx, connect.NewRequest(&eitriv1.GetHostRequest{Id: en.Msg.HostId}))
		return err == nil && h.Msg.Host.Connected && h.Msg.Host.Capacity != nil
	}, 10*time.Second, 10*time.Millisecond, "the docs' host connects")
}

// prelude carries what blocks define from one to the next (they run in
// separate bash processes, so each can be judged on its own).
const prelude = `set -eo pipefail
declare -A __before
while IFS= read -r __l; do __before[$__l]=1; done < <(declare -p)
[ -f "$DOCTEST_STATE" ] && . "$DOCTEST_STATE"
__save() {
	local v d
	for v in $(compgen -v); do
		case "$v" in __* | v | d | BASH* | FUNCNAME | PIPESTATUS | LINENO | RANDOM | SECONDS | SRANDOM | EPOCH*) continue ;; esac
		d=$(declare -p "$v" 2>/dev/null) || continue
		[[ $d =~ ^declare\ -[a-zA-Z]*r ]] && continue # readonly
		[[ ${__before[$d]+set} ]] && continue # unchanged since the start
		echo "$d"
	done >"$DOCTEST_STATE.next"
	declare -f >>"$DOCTEST_STATE.next"
}
trap __save EXIT
`

// run executes one sh block and checks it.
func run(t *testing.T, env []string, dir, state string, b *block) {
	t.Helper()
	script := filepath.Join(dir, "block.sh")
	require.NoError(t, os.WriteFile(script, []byte(prelude+b.text), 0o600))
	cmd := exec.Command("bash", script)
	cmd.Dir, cmd.Env = dir, append(env, "DOCTEST_STATE="+state)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Start())
	ended := make(chan error, 1)
	go func() { ended <- cmd.Wait() }()

	limit, interrupt := time.Minute, false
	if d, ok := strings.CutPrefix(b.directive, "interrupt "); ok {
		var err error
		limit, err = time.ParseDuration(d)
		require.NoError(t, err, "line %d: directive %q", b.line, b.directive)
		interrupt = true
	}
	var err error
	select {
	case err = <-ended:
		if interrupt {
			t.Fatalf("line %d: the block ended by itself (%v) before it was interrupted\nstdout:\n%s\nstderr:\n%s", b.line, err, &stdout, &stderr)
		}
		if err != nil {
			t.Fatalf("line %d: %v\n%s\nstdout:\n%s\nstderr:\n%s", b.line, err, b.text, &stdout, &stderr)
		}
		require.NoError(t, os.Rename(state+".next", state))

	case <-time.After(limit):
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGINT)
		select {
		case <-ended:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-ended
			t.Fatalf("line %d: the block did not stop on SIGINT", b.line)
		}
		if !interrupt {
			t.Fatalf("line %d: still running after %s\nstdout:\n%s\nstderr:\n%s", b.line, limit, &stdout, &stderr)
		}
	}
	if b.output != nil {
		if err := matchOutput(b.output, stdout.String()); err != nil {
			t.Fatalf("line %d: the output is not what line %d shows: %v\n%s\nstdout:\n%s\nstderr:\n%s", b.line, b.output.line, err, b.text, &stdout, &stderr)
		}
	}
}

func matchOutput(want *block, got string) error {
	switch want.lang {
	case "json":
		w, err := jsonValues(want.text)
		if err != nil {
			return fmt.Errorf("the doc's JSON: %w", err)
		}
		g, err := jsonValues(got)
		if err != nil {
			return fmt.Errorf("the output is not JSON: %w", err)
		}
		return inOrder(len(w), len(g), func(i, j int) bool { return matchJSON(w[i], g[j]) == nil },
			func(i int) error {
				// Say why the closest candidate differs.
				for _, gv := range g {
					if err := matchJSON(w[i], gv); err != nil {
						return fmt.Errorf("value %d: %w", i+1, err)
					}
				}
				return fmt.Errorf("value %d not found", i+1)
			})
	default:
		var w []string
		for _, l := range strings.Split(want.text, "\n") {
			if strings.TrimSpace(l) != "" {
				w = append(w, l)
			}
		}
		g := strings.Split(got, "\n")
		return inOrder(len(w), len(g), func(i, j int) bool { return pattern(strings.TrimSpace(w[i])).MatchString(strings.TrimSpace(g[j])) },
			func(i int) error { return fmt.Errorf("no line like %q", w[i]) })
	}
}

// inOrder checks that every wanted item i matches some got item, in order.
func inOrder(nw, ng int, match func(i, j int) bool, missing func(i int) error) error {
	j := 0
	for i := range nw {
		for j < ng && !match(i, j) {
			j++
		}
		if j == ng {
			return missing(i)
		}
		j++
	}
	return nil
}

func jsonValues(s string) ([]any, error) {
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	var out []any
	for {
		var v any
		err := dec.Decode(&v)
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
}

// pattern turns a shown string into a regexp: "…" is anything.
func pattern(s string) *regexp.Regexp {
	parts := strings.Split(s, "…")
	for i, p := range parts {
		parts[i] = regexp.QuoteMeta(p)
	}
	return regexp.MustCompile("^" + strings.Join(parts, ".*") + "$")
}

func matchJSON(want, got any) error {
	switch w := want.(type) {
	case map[string]any:
		g, ok := got.(map[string]any)
		if !ok {
			return fmt.Errorf("want an object, got %v", got)
		}
		for k, wv := range w {
			gv, ok := g[k]
			if !ok {
				return fmt.Errorf("no %q", k)
			}
			if err := matchJSON(wv, gv); err != nil {
				return fmt.Errorf("%s: %w", k, err)
			}
		}
		return nil
	case []any:
		g, ok := got.([]any)
		if !ok {
			return fmt.Errorf("want an array, got %v", got)
		}
		if len(w) == 0 && len(g) != 0 {
			return fmt.Errorf("want an empty array, got %d items", len(g))
		}
		return inOrder(len(w), len(g), func(i, j int) bool { return matchJSON(w[i], g[j]) == nil },
			func(i int) error { return fmt.Errorf("item %d (%v) not found", i, w[i]) })
	case string:
		if g, ok := got.(string); ok && pattern(w).MatchString(g) {
			return nil
		}
		return fmt.Errorf("want %q, got %v", w, got)
	default:
		if fmt.Sprint(want) != fmt.Sprint(got) {
			return fmt.Errorf("want %v, got %v", want, got)
		}
		return nil
	}
}

// runDoc runs every sh block of the markdown file at path, except those
// whose first line starts with a key of notRun (which says why not).
func runDoc(t *testing.T, path string, notRun map[string]string) {
	md, err := os.ReadFile(path)
	require.NoError(t, err)
	blocks := parse(string(md))
	url, token := controlPlane(t)
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	dir := t.TempDir()
	bins := []string{filepath.Join(root, "node_modules", ".bin")}
	if bin := os.Getenv("EITRI_BIN"); bin != "" {
		// The CLI, for snippets that use it.
		bins = append(bins, filepath.Dir(bin))
	}
	env := append(os.Environ(),
		"EITRI_URL="+url, "EITRI_TOKEN="+token,
		"PATH="+strings.Join(append(bins, os.Getenv("PATH")), string(os.PathListSeparator)))
	state := filepath.Join(dir, "state.sh")
	ran, used := 0, map[string]bool{}
	for _, b := range blocks {
		if b.lang != "sh" {
			continue
		}
		first, _, _ := strings.Cut(strings.TrimSpace(b.text), "\n")
		if why, ok := skipped(first, notRun); ok {
			used[why] = true
			t.Logf("%s:%d not run: %s", path, b.line, why)
			continue
		}
		start := time.Now()
		run(t, env, dir, state, b)
		t.Logf("%s:%d ran in %s", path, b.line, time.Since(start).Round(time.Millisecond))
		ran++
	}
	require.NotZero(t, ran, "no sh blocks in %s", path)
	for key, why := range notRun {
		require.True(t, used[why], "%s: no block starts with %q any more; drop it from the list", path, key)
	}
}

func skipped(first string, notRun map[string]string) (string, bool) {
	for key, why := range notRun {
		if strings.HasPrefix(first, key) {
			return why, true
		}
	}
	return "", false
}

func TestAPIDocRuns(t *testing.T) {
	if _, err := os.Stat("../node_modules/.bin/buf"); err != nil {
		t.Fatalf("the buf CLI is not installed (make deps installs it): %v", err)
	}
	runDoc(t, "api.md", nil)
}

// The README's snippets that cannot run here, and why. Every other sh block
// in it runs; a new one runs unless it is added here with its reason.
var readmeNotRun = map[string]string{
	"make run":                               "builds and starts eitri dev for good (make test runs this test)",
	"eitri image add debian-12":              "fetches Debian's SHA512SUMS and image from the internet, which tests do not reach (server/api's catalogue tests add from SUMS files and signatures served on loopback)",
	`export PATH="$PWD/bin`:                  "logs in to eitri dev's port 8080 with its data dir's token; this test has its own control plane (cmd/eitri's login tests cover eitri login)",
	"export EITRI_URL=http://127.0.0.1:8080": "points at eitri dev's port 8080 and data dir; this test sets EITRI_URL and EITRI_TOKEN for its own control plane",
	"install -m 0644 deploy":                 "installs systemd units on this machine",
	"eitri host join-token":                  "installs and starts an agent under systemd",
	"sqlite3 /var/lib/eitri":                 "backs up /var/lib/eitri of an installed control plane",
	"npm pack /path/to/eitri":                "installs packages into the directory it runs in; make test's gen/ts node test uses the same package with connect-node",
	"sudo -u postgres createuser":            "creates a role and a database in the machine's own PostgreSQL (server/store/pgtest runs a PostgreSQL of its own for the tests)",
	"cat > /etc/default/eitri-server":        "configures and starts an installed control plane under systemd (cmd/eitri's replica tests run replicas on PostgreSQL)",
	"systemctl stop eitri-server":            "moves an installed control plane's database (cmd/eitri's migrate-db tests run the same command on a fleet of their own)",
	"eitri release keygen --dir":             "makes a release key and configures an installed control plane with it (cmd/eitri's upgrade tests make and use one)",
	"eitri release sign bin/eitri":           "signs, uploads and rolls out a build to a fleet of agents (cmd/eitri's TestTwoAgentsUpgradeFromBuildAToBuildBWithoutTouchingAGuest runs these commands on one)",
}

func TestREADMERuns(t *testing.T) {
	runDoc(t, "../README.md", readmeNotRun)
}
