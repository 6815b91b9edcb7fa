package imagecache

import (
	"errors"
	"fmt"
)

// Sentinels for the causes a caller may want to tell apart. Each is wrapped
// with the specifics (URL, digests, sizes), so match them with errors.Is.
var (
	ErrInvalidDigest    = errors.New("invalid sha256")
	ErrChecksumMismatch = errors.New("image sha256 mismatch")
	ErrTooLarge         = errors.New("image larger than the cache cap")
	ErrUnsupported      = errors.New("unsupported image")
	ErrCorrupt          = errors.New("corrupt image")
)

// PermanentError marks a failure that retrying the same Ensure cannot fix:
// the bytes served are wrong, the image cannot be decoded, the URL names
// nothing. The reconcile engine looks for the Permanent method via errors.As
// and fails the create at once instead of spending its retry budget.
type PermanentError struct {
	Err error
}

func (e *PermanentError) Error() string   { return e.Err.Error() }
func (e *PermanentError) Unwrap() error   { return e.Err }
func (e *PermanentError) Permanent() bool { return true }

// permanent wraps err as permanent; nil stays nil.
func permanent(err error) error {
	if err == nil {
		return nil
	}
	var p *PermanentError
	if errors.As(err, &p) {
		return err
	}
	return &PermanentError{Err: err}
}

// permanentf formats a permanent error; %w works as in fmt.Errorf.
func permanentf(format string, args ...any) error {
	return &PermanentError{Err: fmt.Errorf(format, args...)}
}

// IsPermanent reports whether err, or anything it wraps, says it is permanent.
func IsPermanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}
