package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeQMP serves one QMP session on a unix socket: it greets, then answers
// each command with the scripted reply lines (events may come first).
func fakeQMP(t *testing.T, replies map[string][]string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "qmp.sock")
	ln, err := net.Listen("unix", path)
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		w := bufio.NewWriter(conn)
		w.WriteString(`{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}` + "\n")
		w.Flush()
		dec := json.NewDecoder(conn)
		for {
			var req struct {
				Execute string `json:"execute"`
			}
			if dec.Decode(&req) != nil {
				return
			}
			lines, ok := replies[req.Execute]
			if !ok {
				lines = []string{`{"error": {"class": "CommandNotFound", "desc": "The command ` + req.Execute + ` has not been found"}}`}
			}
			for _, l := range lines {
				w.WriteString(l + "\n")
			}
			w.Flush()
		}
	}()
	return path
}

func TestQMPClient(t *testing.T) {
	path := fakeQMP(t, map[string][]string{
		"qmp_capabilities": {`{"return": {}}`},
		"query-status": {
			`{"event": "RESET", "data": {"guest": true}, "timestamp": {"seconds": 1, "microseconds": 2}}`,
			`{"return": {"status": "paused", "running": false}}`,
		},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	q, err := dialQMP(ctx, path)
	require.NoError(t, err)
	defer q.Close()

	var st qmpStatus
	require.NoError(t, q.execute("query-status", nil, &st), "events before the return must be skipped")
	assert.Equal(t, qmpStatus{Running: false, Status: "paused"}, st)

	err = q.execute("bogus", nil, nil)
	var qerr *QMPError
	require.ErrorAs(t, err, &qerr)
	assert.Equal(t, "CommandNotFound", qerr.Class)
}

func TestQMPNotAServer(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.sock")
	ln, err := net.Listen("unix", path)
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		conn, err := ln.Accept()
		if err == nil {
			conn.Write([]byte(`{"hello": "world"}` + "\n"))
			conn.Close()
		}
	}()
	_, err = dialQMP(context.Background(), path)
	assert.ErrorContains(t, err, "not a QMP server")
}

func TestIOStatsSumsEveryBlockDeviceAndLeavesAMissingBalloonUnsaid(t *testing.T) {
	path := fakeQMP(t, map[string][]string{
		"qmp_capabilities": {`{"return": {}}`},
		"query-blockstats": {`{"return": [` +
			`{"device": "", "qdev": "root", "stats": {"rd_bytes": 1000, "wr_bytes": 200, "rd_operations": 10, "wr_operations": 2}},` +
			`{"device": "", "qdev": "seed", "stats": {"rd_bytes": 24, "wr_bytes": 0, "rd_operations": 1, "wr_operations": 0}}]}`},
		"query-balloon": {`{"error": {"class": "DeviceNotActive", "desc": "No balloon device has been activated"}}`},
	})
	q, err := dialQMP(context.Background(), path)
	require.NoError(t, err)
	defer q.Close()
	got, err := queryIOStats(q)
	require.NoError(t, err)
	assert.Equal(t, DiskIO{ReadBytes: 1024, WriteBytes: 200, ReadOps: 11, WriteOps: 2}, got.Disk)
	assert.Nil(t, got.BalloonBytes, "a guest without a balloon has no balloon figure, not 0")
}

func TestIOStatsReadsTheBalloonWhenThereIsOne(t *testing.T) {
	path := fakeQMP(t, map[string][]string{
		"qmp_capabilities": {`{"return": {}}`},
		"query-blockstats": {`{"return": []}`},
		"query-balloon":    {`{"return": {"actual": 268435456}}`},
	})
	q, err := dialQMP(context.Background(), path)
	require.NoError(t, err)
	defer q.Close()
	got, err := queryIOStats(q)
	require.NoError(t, err)
	require.NotNil(t, got.BalloonBytes)
	assert.Equal(t, uint64(256<<20), *got.BalloonBytes)
}
