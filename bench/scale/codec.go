package main

import (
	"fmt"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// leanCodec is the watchers' binary codec: it reads of a change only what
// the measurement needs (the object's id and its narration or session
// counter) straight from the wire. A thousand consoles decoding every
// field in this one process would spend the machine's CPU on the
// simulator, not on the control plane being measured. The stream, its
// framing and the bytes on it are the real ones.
type leanCodec struct{}

var (
	vmChanged  = field(&eitriv1.WatchVMsResponse{}, "changed")
	vmID       = field(&eitriv1.VM{}, "id")
	vmDetail   = field(&eitriv1.VM{}, "status_detail")
	expChanged = field(&eitriv1.WatchExposuresResponse{}, "changed")
	expID      = field(&eitriv1.Exposure{}, "id")
	expSess    = field(&eitriv1.Exposure{}, "sessions")
	sessActive = field(&eitriv1.ExposureSessions{}, "active")
)

func field(m proto.Message, name protoreflect.Name) protowire.Number {
	f := m.ProtoReflect().Descriptor().Fields().ByName(name)
	if f == nil {
		panic(fmt.Sprintf("%T has no field %s", m, name))
	}
	return f.Number()
}

func (leanCodec) Name() string { return "proto" }

func (leanCodec) Marshal(v any) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }

func (leanCodec) Unmarshal(b []byte, v any) error {
	switch m := v.(type) {
	case *eitriv1.WatchVMsResponse:
		m.Reset()
		if sub, ok := find(b, vmChanged); ok {
			vm := &eitriv1.VM{}
			walk(sub, func(n protowire.Number, val []byte, _ uint64) {
				switch n {
				case vmID:
					vm.Id = string(val)
				case vmDetail:
					vm.StatusDetail = string(val)
				}
			})
			m.Event = &eitriv1.WatchVMsResponse_Changed{Changed: vm}
		}
		return nil
	case *eitriv1.WatchExposuresResponse:
		m.Reset()
		if sub, ok := find(b, expChanged); ok {
			e := &eitriv1.Exposure{}
			walk(sub, func(n protowire.Number, val []byte, _ uint64) {
				switch n {
				case expID:
					e.Id = string(val)
				case expSess:
					walk(val, func(n protowire.Number, _ []byte, x uint64) {
						if n == sessActive {
							e.Sessions = &eitriv1.ExposureSessions{Active: int64(x)}
						}
					})
				}
			})
			m.Event = &eitriv1.WatchExposuresResponse_Changed{Changed: e}
		}
		return nil
	}
	return proto.Unmarshal(b, v.(proto.Message))
}

// find returns the bytes of field n (length-delimited) in b.
func find(b []byte, n protowire.Number) (out []byte, ok bool) {
	walk(b, func(num protowire.Number, val []byte, _ uint64) {
		if num == n {
			out, ok = val, true
		}
	})
	return out, ok
}

// walk calls f for every field of b: val for length-delimited fields, x
// for varints.
func walk(b []byte, f func(n protowire.Number, val []byte, x uint64)) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return
		}
		b = b[n:]
		switch typ {
		case protowire.BytesType:
			val, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return
			}
			f(num, val, 0)
			b = b[n:]
		case protowire.VarintType:
			x, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return
			}
			f(num, nil, x)
			b = b[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return
			}
			b = b[n:]
		}
	}
}
