package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// escapeKey leaves `eitri vm console`: Ctrl-], as telnet and virsh have it.
const escapeKey = 0x1d

// maxConsoleInput is the API's bound on one SendConsoleInput.
const maxConsoleInput = 4096

func newVMConsoleCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "console NAME|ID",
		Short: "Attach to a VM's serial console (Ctrl-] leaves)",
		Long: "Shows the VM's serial console, its recent output then live, and types what you type into it.\n" +
			"The terminal is raw while attached; Ctrl-] (or the end of input) leaves.",
		Args:              needArgs("a VM name or id"),
		ValidArgsFunction: a.completeVMs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.onVM(func(ctx context.Context, c *client, id string) error {
				return c.attachConsole(ctx, id, args[0], a.io.In)
			})(cmd, args)
		},
	}
}

func newVMLogsCmd(a *app) *cobra.Command {
	var follow bool
	var tail uint32
	cmd := &cobra.Command{
		Use:               "logs NAME|ID",
		Short:             "Print a VM's serial console output (-f: and follow it)",
		Args:              needArgs("a VM name or id"),
		ValidArgsFunction: a.completeVMs,
		RunE: a.onVM(func(ctx context.Context, c *client, id string) error {
			req := &eitriv1.StreamConsoleRequest{VmId: id, TailBytes: tail, NoFollow: !follow}
			return c.streamConsole(ctx, req, follow, func(data []byte, newBoot bool) {
				if newBoot {
					fmt.Fprintln(c.out, "---- the VM started again ----")
				}
				_, _ = c.out.Write(data)
			})
		}),
	}
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "keep printing what the VM writes, across reboots, until interrupted")
	cmd.Flags().Uint32Var(&tail, "tail", 0, "bytes of recent output to print first (default 16 KiB, at most 1 MiB)")
	return cmd
}

// streamConsole hands the VM's serial output to write. Following, a lost
// stream is opened again from the last byte written (so nothing repeats),
// with a growing wait; otherwise it ends with the output so far.
func (c *client) streamConsole(ctx context.Context, req *eitriv1.StreamConsoleRequest, follow bool, write func(data []byte, newBoot bool)) error {
	wait := 500 * time.Millisecond
	for {
		st, err := c.vm.StreamConsole(ctx, connect.NewRequest(req))
		if err == nil {
			for st.Receive() {
				m := st.Msg()
				wait = 500 * time.Millisecond
				if len(m.Data) > 0 || m.NewBoot {
					write(m.Data, m.NewBoot)
				}
				if m.Boot != "" {
					req.Boot, req.Offset = m.Boot, m.Offset+int64(len(m.Data))
				}
			}
			err = st.Err()
			st.Close()
		}
		if ctx.Err() != nil {
			return nil
		}
		if !follow || !retryable(err) {
			if err == nil {
				return nil
			}
			return apiError(err)
		}
		if err == nil {
			err = errors.New("the stream ended")
		}
		fmt.Fprintf(c.errOut, "\r\neitri: console: %v; reconnecting in %s\r\n", apiError(err), wait)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		wait = min(wait*2, 10*time.Second)
	}
}

// retryable: the control plane or the VM's host is away for now.
func retryable(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable, connect.CodeAborted, connect.CodeInternal, connect.CodeUnknown, connect.CodeCanceled, connect.CodeDeadlineExceeded:
		return true
	}
	return err == nil
}

// attachConsole shows the console live and types stdin into it until
// Ctrl-], the end of stdin, or an error.
func (c *client) attachConsole(ctx context.Context, id, name string, in io.Reader) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if f, ok := in.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		old, err := term.MakeRaw(int(f.Fd()))
		if err != nil {
			return fmt.Errorf("console: raw terminal: %w", err)
		}
		defer func() { _ = term.Restore(int(f.Fd()), old) }()
	}
	fmt.Fprintf(c.errOut, "Connected to the serial console of %s; Ctrl-] leaves.\r\n", name)

	outErr := make(chan error, 1)
	go func() {
		outErr <- c.streamConsole(ctx, &eitriv1.StreamConsoleRequest{VmId: id}, true, func(data []byte, newBoot bool) {
			if newBoot {
				fmt.Fprint(c.out, "\r\n---- the VM started again ----\r\n")
			}
			_, _ = c.out.Write(data)
		})
	}()
	keys := make(chan []byte)
	go func() {
		defer close(keys)
		buf := make([]byte, maxConsoleInput)
		for {
			n, err := in.Read(buf)
			if n > 0 {
				select {
				case keys <- append([]byte(nil), buf[:n]...):
				case <-ctx.Done():
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	for {
		select {
		case err := <-outErr:
			return err
		case k, ok := <-keys:
			if !ok {
				return nil // the end of input
			}
			leave := false
			if i := bytes.IndexByte(k, escapeKey); i >= 0 {
				k, leave = k[:i], true
			}
			if err := c.typeKeys(ctx, id, k); err != nil {
				return err
			}
			if leave {
				fmt.Fprint(c.errOut, "\r\n")
				return nil
			}
		}
	}
}

// typeKeys sends keys in batches the API takes. Typing too fast waits and
// tries again; a VM that takes no input (stopped) is said, and the session
// goes on, showing its output.
func (c *client) typeKeys(ctx context.Context, id string, keys []byte) error {
	for len(keys) > 0 {
		n := min(len(keys), maxConsoleInput)
		_, err := c.vm.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: keys[:n]}))
		switch connect.CodeOf(err) {
		case connect.CodeResourceExhausted:
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(300 * time.Millisecond):
			}
			continue
		case connect.CodeFailedPrecondition, connect.CodeUnavailable:
			fmt.Fprintf(c.errOut, "\r\neitri: console input: %v\r\n", apiError(err))
			return nil
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return apiError(err)
		}
		keys = keys[n:]
	}
	return nil
}
