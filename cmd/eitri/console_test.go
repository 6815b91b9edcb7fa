package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/a73x/eitri/agent/consolerelay"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/agent/syncclient"
	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/wire/connclient"
)

// consoleHost is an enrolled host whose agent runs the real console relay
// over a real QEMU backend in a temp dir; the test writes the serial log
// (and plays QEMU's input socket) itself.
func (e *cliEnv) consoleHost(name string) (*qemu.Backend, state.Identity) {
	e.t.Helper()
	qb, err := qemu.New(qemu.Config{Dir: e.t.TempDir()})
	require.NoError(e.t, err)
	return qb, e.relayHost(name, &scriptedHost{}, consolerelay.Config{Serial: qb})
}

// relayHost is an enrolled host reporting what src says, whose agent runs
// the real call relay configured by cfg (its client and identity are
// filled in here).
func (e *cliEnv) relayHost(name string, src *scriptedHost, cfg consolerelay.Config) state.Identity {
	e.t.Helper()
	id := e.enroll(name)
	ctx, cancel := context.WithCancel(context.Background())
	e.t.Cleanup(cancel)
	hc := connclient.HTTPClient("")
	go func() {
		_ = syncclient.Run(ctx, syncclient.Config{Identity: id, Source: src, ReportEvery: 10 * time.Millisecond, Client: hc,
			Hello: func() *eitriv1.Hello { return &eitriv1.Hello{AgentVersion: "test", InstanceId: "agent-1"} }})
	}()
	cfg.Client, cfg.Identity, cfg.InstanceID = hc, id, "agent-1"
	go func() { _ = consolerelay.Run(ctx, cfg) }()
	require.Eventually(e.t, func() bool {
		out, err := e.eitri("host", "get", name, "-o", "json")
		var r eitriv1.GetHostResponse
		return err == nil && protojson.Unmarshal([]byte(out), &r) == nil && r.Host.Connected && r.Host.Capacity != nil
	}, 10*time.Second, 10*time.Millisecond, "the host is connected and has reported its capacity")
	return id
}

func TestVMLogsPrintsTheSerialConsoleAndFollowsIt(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	qb, _ := e.consoleHost("h1")
	out, err := e.eitri("vm", "create", "web-1", "--image", "http://images.test/g.raw", "--sha256", strings.Repeat("ab", 32), "-o", "json")
	require.NoError(t, err)
	var created eitriv1.CreateVMResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &created), out)
	dir := qb.VMDir(created.Vm.Id)
	require.NoError(t, os.MkdirAll(dir, 0o700))
	log := filepath.Join(dir, "serial.log")
	require.NoError(t, os.WriteFile(log, []byte("Linux version 6.1\nlogin: "), 0o600))

	out, err = e.eitri("vm", "logs", "web-1")
	require.NoError(t, err)
	assert.Equal(t, "Linux version 6.1\nlogin: ", out, "the output so far, and the command ends")

	out, err = e.eitri("vm", "logs", "web-1", "--tail", "7")
	require.NoError(t, err)
	assert.Equal(t, "login: ", out)

	ctx, stop := context.WithCancel(context.Background())
	followed := &outputtest.Buffer{}
	done := make(chan error, 1)
	go func() {
		done <- execute(ctx, []string{"vm", "logs", "web-1", "-f"}, cli.IO{In: strings.NewReader(""), Out: followed, Err: followed})
	}()
	require.Eventually(t, func() bool { return followed.String() == "Linux version 6.1\nlogin: " }, 10*time.Second, 10*time.Millisecond)
	f, err := os.OpenFile(log, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.WriteString("root\n")
	require.NoError(t, err)
	require.NoError(t, f.Close())
	require.Eventually(t, func() bool { return strings.HasSuffix(followed.String(), "login: root\n") }, 10*time.Second, 10*time.Millisecond,
		"-f prints what the VM writes next")
	stop()
	require.NoError(t, <-done, "an interrupted follow ends cleanly")

	_, err = e.eitri("vm", "logs", "no-such-vm")
	require.Error(t, err)
}

func TestVMConsoleTypesIntoTheGuestUntilCtrlRightBracket(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	qb, _ := e.consoleHost("h1")
	out, err := e.eitri("vm", "create", "web-1", "--image", "http://images.test/g.raw", "--sha256", strings.Repeat("ab", 32), "-o", "json")
	require.NoError(t, err)
	var created eitriv1.CreateVMResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &created), out)
	dir := qb.VMDir(created.Vm.Id)
	require.NoError(t, os.MkdirAll(dir, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "serial.log"), []byte("login: "), 0o600))

	// Stopped: the console shows the output and says it takes no input.
	var shown, said outputtest.Buffer
	err = execute(context.Background(), []string{"vm", "console", "web-1"}, cli.IO{In: strings.NewReader("x\x1d"), Out: &shown, Err: &said})
	require.NoError(t, err)
	assert.Contains(t, said.String(), "Ctrl-] leaves")
	assert.Contains(t, said.String(), "not running")

	// Running: this plays the VM's QEMU (its command line names the VM's
	// pidfile and serial socket) and listens on its serial socket.
	sock := filepath.Join(dir, "serial.sock")
	ln, err := net.Listen("unix", sock)
	require.NoError(t, err)
	defer ln.Close()
	pidfile := filepath.Join(dir, "qemu.pid")
	cmd := exec.Command("sh", "-c", "sleep 60", "-pidfile", pidfile,
		"-chardev", "socket,id=serial0,path="+sock+",server=on,wait=off,logfile="+filepath.Join(dir, "serial.log"))
	require.NoError(t, cmd.Start())
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	require.NoError(t, os.WriteFile(pidfile, []byte(strconv.Itoa(cmd.Process.Pid)), 0o600))
	typed := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		var got bytes.Buffer
		buf := make([]byte, 64)
		for got.Len() < len("root\r") {
			n, err := c.Read(buf)
			if err != nil {
				break
			}
			got.Write(buf[:n])
		}
		typed <- got.String()
	}()
	err = execute(context.Background(), []string{"vm", "console", "web-1"}, cli.IO{In: strings.NewReader("root\r\x1dnot typed"), Out: &shown, Err: &said})
	require.NoError(t, err)
	select {
	case s := <-typed:
		assert.Equal(t, "root\r", s, "what is typed before Ctrl-] reaches the guest, and nothing after")
	case <-time.After(10 * time.Second):
		t.Fatal("nothing was typed into the guest")
	}
}
