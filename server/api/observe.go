package api

import (
	"context"
	"errors"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// Observer is told of the API's calls as they end, its streams as they open
// and close, and its agents' Sync sessions and reports; the control plane's
// own metrics implement it. Procedure names it gets are ProcedureLabel's.
// Every method must be cheap: it runs on each call's path.
type Observer interface {
	// Finished: a call ended with err (nil for success); a unary call says
	// how long its handler took.
	Finished(procedure string, unary bool, err error, d time.Duration)
	StreamOpened(procedure string)
	StreamClosed(procedure string)
	// SyncOpened and SyncClosed bracket an agent's session.
	SyncOpened()
	SyncClosed()
	// ReportApplied: lag from reading an agent's report off its stream to
	// having applied it.
	ReportApplied(lag time.Duration)
}

// OtherProcedure stands for every path that names no procedure of the API.
const OtherProcedure = "other"

// procedures is every procedure the generated services define, by path:
// every service of the package, so a new one is known without a list here.
var procedures = func() map[string]string {
	out := map[string]string{}
	protoregistry.GlobalFiles.RangeFilesByPackage(eitriv1.File_eitri_v1_vm_proto.Package(), func(f protoreflect.FileDescriptor) bool {
		for i := range f.Services().Len() {
			svc := f.Services().Get(i)
			for j := range svc.Methods().Len() {
				p := "/" + string(svc.FullName()) + "/" + string(svc.Methods().Get(j).Name())
				out[p] = p
			}
		}
		return true
	})
	return out
}()

// ProcedureLabel is path when it names one of the API's procedures, else
// OtherProcedure: a caller choosing paths cannot mint new metric series.
func ProcedureLabel(path string) string {
	if p, ok := procedures[path]; ok {
		return p
	}
	return OtherProcedure
}

// observing reports every call to an Observer. It is the outermost
// interceptor, so refusals by the ones inside it (authentication, stream
// quota) are counted with their codes.
type observing struct{ obs Observer }

func (o observing) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		start := time.Now()
		resp, err := next(ctx, req)
		o.obs.Finished(ProcedureLabel(req.Spec().Procedure), true, err, time.Since(start))
		return resp, err
	}
}

func (o observing) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (o observing) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		p := ProcedureLabel(conn.Spec().Procedure)
		o.obs.StreamOpened(p)
		defer o.obs.StreamClosed(p)
		err := next(ctx, conn)
		o.obs.Finished(p, false, err, 0)
		return err
	}
}

// observeUnrouted counts a request under a service's prefix that names no
// procedure of it: the service answers 404, which Connect clients read as
// Unimplemented, and no interceptor sees it.
var errNoProcedure = connect.NewError(connect.CodeUnimplemented, errors.New("no such procedure"))

func observeUnrouted(obs Observer, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := procedures[r.URL.Path]; !ok {
			obs.Finished(OtherProcedure, false, errNoProcedure, 0)
		}
		next.ServeHTTP(w, r)
	})
}
