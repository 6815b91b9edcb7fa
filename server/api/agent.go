package api

import (
	"context"
	"errors"
	"time"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
)

type agentService struct{ handlers }

// received is a report and when it was read off the stream.
type received struct {
	report *eitriv1.ActualStateReport
	at     time.Time
}

func (s agentService) Enroll(ctx context.Context, r *connect.Request[eitriv1.EnrollRequest]) (*connect.Response[eitriv1.EnrollResponse], error) {
	resp, err := s.f.Enroll(ctx, r.Msg)
	return reply(s.handlers, resp, err)
}

// Sync runs one host's stream: snapshots out whenever its desired state
// changes (and once on connect), complete reports in.
func (s agentService) Sync(ctx context.Context, st *connect.BidiStream[eitriv1.SyncRequest, eitriv1.SyncResponse]) error {
	cred := auth.Secret(st.RequestHeader())
	if cred == "" {
		return connect.NewError(connect.CodeUnauthenticated, errors.New("missing host credential"))
	}
	hostID, err := s.f.HostByCredential(ctx, cred)
	if err != nil {
		return s.toConnect(err)
	}
	first, err := st.Receive()
	if err != nil {
		return err
	}
	hello := first.GetHello()
	if hello == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("the first message on a Sync stream must be hello"))
	}
	hello.HostId = hostID // the credential, not the message, says who this is

	sess, err := s.f.OpenSession(ctx, hostID, hello, st.Peer().Addr)
	if err != nil {
		return s.toConnect(err)
	}
	defer sess.Close()
	s.obs.SyncOpened()
	defer s.obs.SyncClosed()

	// Receive in its own goroutine: a blocked Receive cannot watch for the
	// session being replaced. Returning from the handler unblocks it.
	reports := make(chan received)
	recvErr := make(chan error, 1)
	go func() {
		for {
			msg, err := st.Receive()
			if err != nil {
				recvErr <- err
				return
			}
			if u := msg.GetUsage(); u != nil {
				// Samples are not state: taken as they come, beside the
				// reports, never queued behind them.
				sess.Usage(ctx, u)
				continue
			}
			if c := msg.GetImageCache(); c != nil {
				sess.ImageCache(c)
				continue
			}
			if rep := msg.GetReport(); rep != nil {
				select {
				case reports <- received{rep, time.Now()}:
				case <-sess.Context().Done():
					return
				}
			}
		}
	}()

	for {
		select {
		case <-sess.Context().Done():
			if err := shutdownErr(sess.Context()); err != nil {
				return err
			}
			cause := context.Cause(sess.Context())
			return connect.NewError(connect.CodeAborted, cause)
		case <-recvErr:
			// The agent hung up (or the request ended); it reconnects and
			// resends a full report, so there is nothing to keep.
			return shutdownErr(ctx)
		case rep := <-reports:
			sess.Apply(ctx, rep.report)
			s.obs.ReportApplied(time.Since(rep.at))
		case <-sess.Kicks():
			snap, err := sess.Snapshot(ctx)
			if err != nil {
				return s.toConnect(err)
			}
			if err := st.Send(&eitriv1.SyncResponse{Msg: &eitriv1.SyncResponse_Snapshot{Snapshot: snap}}); err != nil {
				return err
			}
		}
	}
}
