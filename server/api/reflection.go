package api

import (
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"connectrpc.com/grpcreflect"
	"github.com/go-chi/chi/v5"

	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// UserServices are the services people and their programs call; reflection
// lists these (the agent's service is for hosts, not for browsing).
var UserServices = []string{
	eitriv1connect.VMServiceName,
	eitriv1connect.ExposureServiceName,
	eitriv1connect.HostServiceName,
	eitriv1connect.ReleaseServiceName,
	eitriv1connect.TokenServiceName,
	eitriv1connect.QuotaServiceName,
	eitriv1connect.SSHServiceName,
	eitriv1connect.UsageServiceName,
}

// Reflection paths: gRPC server reflection, v1 and the v1alpha older tools
// (grpcurl before 1.8.8, some IDEs) still ask for.
const (
	reflectionV1Prefix      = "/grpc.reflection.v1.ServerReflection/"
	reflectionV1AlphaPrefix = "/grpc.reflection.v1alpha.ServerReflection/"
)

// IsReflection reports whether path is a gRPC server reflection procedure.
func IsReflection(path string) bool {
	return strings.HasPrefix(path, reflectionV1Prefix) || strings.HasPrefix(path, reflectionV1AlphaPrefix)
}

// MaxReflectionMessage bounds one reflection request: a symbol or file name.
// Reflection needs no credential (the schema is public, like proto/), so a
// request must cost next to nothing.
const MaxReflectionMessage = 4 << 10

// MountReflection serves gRPC server reflection for UserServices, so grpcurl
// and `buf curl --reflect` need no copy of proto/. It is open: what it tells
// is the schema, which is published with the SDKs anyway.
func MountReflection(r chi.Router) {
	reflector := grpcreflect.NewStaticReflector(UserServices...)
	opts := []connect.HandlerOption{connect.WithConditionalHandlerOptions(messageLimits)}
	for _, mount := range []func(*grpcreflect.Reflector, ...connect.HandlerOption) (string, http.Handler){
		grpcreflect.NewHandlerV1, grpcreflect.NewHandlerV1Alpha,
	} {
		path, h := mount(reflector, opts...)
		r.Handle(path+"*", h)
	}
}
