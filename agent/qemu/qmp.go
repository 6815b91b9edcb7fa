package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"
)

// qmpDefaultTimeout bounds one QMP exchange when the caller's context has no
// deadline: a wedged QEMU must not hang the agent.
const qmpDefaultTimeout = 10 * time.Second

// qmpConn is a minimal QMP client: JSON objects over a unix socket, one
// command in flight at a time. It is opened per operation and closed right
// after, because QEMU serves one QMP client at a time and a held connection
// would lock out the next agent process after a restart.
type qmpConn struct {
	conn net.Conn
	dec  *json.Decoder
	enc  *json.Encoder
}

// QMPError is an error QEMU returned for a command.
type QMPError struct {
	Command string
	Class   string
	Desc    string
}

func (e *QMPError) Error() string {
	return fmt.Sprintf("qmp %s: %s: %s", e.Command, e.Class, e.Desc)
}

type qmpMessage struct {
	QMP    json.RawMessage `json:"QMP"`
	Event  string          `json:"event"`
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
}

// dialQMP connects, reads the greeting and leaves capabilities negotiation
// mode so commands can be executed.
func dialQMP(ctx context.Context, path string) (*qmpConn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("qmp dial %s: %w", path, err)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(qmpDefaultTimeout)
	}
	_ = conn.SetDeadline(deadline)
	q := &qmpConn{conn: conn, dec: json.NewDecoder(conn), enc: json.NewEncoder(conn)}

	var greeting qmpMessage
	if err := q.dec.Decode(&greeting); err != nil {
		conn.Close()
		return nil, fmt.Errorf("qmp greeting: %w", err)
	}
	if greeting.QMP == nil {
		conn.Close()
		return nil, errors.New("qmp greeting: peer is not a QMP server")
	}
	if err := q.execute("qmp_capabilities", nil, nil); err != nil {
		conn.Close()
		return nil, err
	}
	return q, nil
}

func (q *qmpConn) Close() error { return q.conn.Close() }

// execute runs one command and decodes its return value into out (if not
// nil). Asynchronous events arriving in between are skipped.
func (q *qmpConn) execute(cmd string, args any, out any) error {
	req := struct {
		Execute   string `json:"execute"`
		Arguments any    `json:"arguments,omitempty"`
	}{cmd, args}
	if err := q.enc.Encode(req); err != nil {
		return fmt.Errorf("qmp %s: send: %w", cmd, err)
	}
	for {
		var m qmpMessage
		if err := q.dec.Decode(&m); err != nil {
			return fmt.Errorf("qmp %s: receive: %w", cmd, err)
		}
		switch {
		case m.Event != "":
			continue
		case m.Error != nil:
			return &QMPError{Command: cmd, Class: m.Error.Class, Desc: m.Error.Desc}
		case m.Return != nil:
			if out == nil {
				return nil
			}
			if err := json.Unmarshal(m.Return, out); err != nil {
				return fmt.Errorf("qmp %s: decode return: %w", cmd, err)
			}
			return nil
		}
	}
}

// qmpStatus is the part of query-status the backend uses.
type qmpStatus struct {
	Running bool   `json:"running"`
	Status  string `json:"status"`
}
