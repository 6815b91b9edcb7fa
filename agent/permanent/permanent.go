// Package permanent marks a failure that retrying on this host cannot fix
// (a missing hypervisor binary, an impossible VM spec, an image whose bytes
// are wrong). The building blocks mark their errors with it and the
// reconcile engine, finding the mark, fails the VM at once instead of
// spending its retry budget. It imports only the standard library, so every
// building block may use it without depending on anything else in eitri.
package permanent

import (
	"errors"
	"fmt"
)

// Error wraps a failure as permanent.
type Error struct{ Err error }

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// Permanent is the mark Is looks for; any error type may carry it (an
// admission refusal, a refused image address) without wrapping in Error.
func (e *Error) Permanent() bool { return true }

// Errorf formats a permanent error; %w works as in fmt.Errorf.
func Errorf(format string, args ...any) error {
	return &Error{Err: fmt.Errorf(format, args...)}
}

// Wrap marks err permanent; nil stays nil, and a permanent error is
// returned as is.
func Wrap(err error) error {
	if err == nil || Is(err) {
		return err
	}
	return &Error{Err: err}
}

// Is reports whether err, or anything it wraps, says it is permanent.
func Is(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}
