// Package intake bounds and cleans what a host sends before the control
// plane keeps any of it. An enrolled host is trusted to run VMs, not to
// fill the control plane's memory, the database or every user's screen, so
// one rule covers every field of every message a host sends, whatever the
// message: fields no message defines (protobuf's unknown fields, which
// would otherwise be kept and passed on) are dropped, every string is cut
// to a bound and has its control characters removed, every bytes field and
// every repeated field is cut to a bound. A field may have a rule of its
// own (a longer bound, newlines kept, its end kept); a field without one
// gets the defaults, so a field added to a host's messages later is
// bounded before anybody thinks of it.
//
// Text past its bound is cut and marked with "…", never refused: a
// report's facts still land.
package intake

import (
	"strings"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Text is how one string field is cleaned.
type Text struct {
	// Max is the bound in bytes (0: the Rules' default).
	Max int
	// Lines keeps newlines and tabs (narration, errors, console tails);
	// otherwise they go with every other control character.
	Lines bool
	// Tail keeps the end of a text past its bound rather than its start
	// (a console's last lines).
	Tail bool
}

// Rules say how each field is bounded. Fields are named by their full
// name, such as "eitri.v1.ActualVM.last_error".
type Rules struct {
	// Text is the rule of each string field that has its own; every other
	// string gets DefaultText.
	Text        map[protoreflect.FullName]Text
	DefaultText Text
	// Items bounds each repeated or map field that has its own bound;
	// every other gets DefaultItems. Past the bound, the rest is dropped.
	Items        map[protoreflect.FullName]int
	DefaultItems int
	// DefaultBytes bounds every bytes field, in bytes; Bytes those that
	// have their own.
	Bytes        map[protoreflect.FullName]int
	DefaultBytes int
}

// Clean bounds and cleans m in place, and every message in it.
func (r *Rules) Clean(m proto.Message) {
	if m == nil {
		return
	}
	r.message(m.ProtoReflect())
}

func (r *Rules) message(m protoreflect.Message) {
	if !m.IsValid() {
		return
	}
	if len(m.GetUnknown()) > 0 {
		m.SetUnknown(nil)
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList():
			r.list(fd, v.List())
		case fd.IsMap():
			r.mapField(fd, v.Map())
		default:
			if nv, ok := r.scalar(fd, v); ok {
				m.Set(fd, nv)
			}
		}
		return true
	})
}

func (r *Rules) items(fd protoreflect.FieldDescriptor) int {
	if n, ok := r.Items[fd.FullName()]; ok {
		return n
	}
	return r.DefaultItems
}

func (r *Rules) list(fd protoreflect.FieldDescriptor, l protoreflect.List) {
	if n := r.items(fd); n > 0 && l.Len() > n {
		l.Truncate(n)
	}
	for i := range l.Len() {
		if nv, ok := r.scalar(fd, l.Get(i)); ok {
			l.Set(i, nv)
		}
	}
}

func (r *Rules) mapField(fd protoreflect.FieldDescriptor, mp protoreflect.Map) {
	n := r.items(fd)
	seen := 0
	var drop []protoreflect.MapKey
	type update struct {
		k protoreflect.MapKey
		v protoreflect.Value
	}
	var set []update
	mp.Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
		seen++
		// A key is text too; one that needs cleaning goes, since a
		// cleaned key could collide with another.
		if n > 0 && seen > n || r.dirtyKey(fd.MapKey(), k) {
			drop = append(drop, k)
			return true
		}
		if nv, ok := r.scalar(fd.MapValue(), v); ok {
			set = append(set, update{k, nv})
		}
		return true
	})
	for _, k := range drop {
		mp.Clear(k)
	}
	for _, u := range set {
		mp.Set(u.k, u.v)
	}
}

func (r *Rules) dirtyKey(fd protoreflect.FieldDescriptor, k protoreflect.MapKey) bool {
	if fd.Kind() != protoreflect.StringKind {
		return false
	}
	s := k.String()
	return r.text(fd, s) != s
}

// scalar cleans one value of fd: a message is cleaned in place, a string
// or bytes value is returned cleaned when it changed.
func (r *Rules) scalar(fd protoreflect.FieldDescriptor, v protoreflect.Value) (protoreflect.Value, bool) {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		r.message(v.Message())
	case protoreflect.StringKind:
		if s := r.text(fd, v.String()); s != v.String() {
			return protoreflect.ValueOfString(s), true
		}
	case protoreflect.BytesKind:
		max := r.DefaultBytes
		if n, ok := r.Bytes[fd.FullName()]; ok {
			max = n
		}
		if b := v.Bytes(); max > 0 && len(b) > max {
			return protoreflect.ValueOfBytes(b[:max:max]), true
		}
	}
	return v, false
}

func (r *Rules) text(fd protoreflect.FieldDescriptor, s string) string {
	t, ok := r.Text[fd.FullName()]
	if !ok {
		t = r.DefaultText
	}
	if t.Max == 0 {
		t.Max = r.DefaultText.Max
	}
	s = Printable(s, t.Lines)
	if t.Tail {
		return ClipFront(s, t.Max)
	}
	return Clip(s, t.Max)
}

// Printable is s with its control characters removed, and invalid UTF-8
// replaced: C0 but (with lines) newline and tab, DEL, and C1
// (U+0080–U+009F, which some terminals obey as escapes: U+009B is CSI,
// U+009D OSC). What a host says reaches terminals and browsers; it tells
// none of them to move a cursor, retitle a window or change colour.
func Printable(s string, lines bool) string {
	if utf8.ValidString(s) && strings.IndexFunc(s, func(r rune) bool { return control(r, lines) }) < 0 {
		return s
	}
	return strings.Map(func(r rune) rune {
		if control(r, lines) {
			return -1
		}
		return r // strings.Map makes invalid bytes U+FFFD
	}, s)
}

func control(r rune, lines bool) bool {
	if lines && (r == '\n' || r == '\t') {
		return false
	}
	return r < 0x20 || r >= 0x7f && r <= 0x9f
}

// Clip cuts s to at most n bytes on a rune boundary, ending in "…"
// (n <= 0: no bound).
func Clip(s string, n int) string {
	if n <= 0 || len(s) <= n {
		return s
	}
	cut := max(n-len("…"), 0)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

// ClipFront is Clip for text whose end matters most (a console's last
// lines): it keeps the last bytes, starting with "…".
func ClipFront(s string, n int) string {
	if n <= 0 || len(s) <= n {
		return s
	}
	cut := len(s) - max(n-len("…"), 0)
	for cut < len(s) && !utf8.RuneStart(s[cut]) {
		cut++
	}
	return "…" + s[cut:]
}
