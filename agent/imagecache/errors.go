package imagecache

import (
	"errors"
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
