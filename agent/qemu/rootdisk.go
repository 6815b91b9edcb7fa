package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"github.com/a73x/eitri/agent/permanent"
)

// PrepareRootDisk makes dst a qcow2 overlay of the raw base image with a
// virtual size of sizeGB GiB.
//
// An overlay rather than a copy or reflink: creating it costs the same for a
// 2 GiB and a 200 GiB base and works on any filesystem (reflinks need btrfs or
// XFS), the base stays shared and untouched, and the guest's writes land only
// in the overlay. The price is that the base must not change while overlays
// use it; to keep an image cache's eviction from pulling it away, dst pins the
// base with a hard link beside it (dst + ".base") when both are on one
// filesystem.
//
// An existing dst is kept as is: it may already hold a guest's data. One
// that is not a qcow2 image at all (an empty or torn file a power loss left
// by an older agent) holds nothing and is made again: booted, it would be
// taken for a blank raw disk. A new overlay is on disk (file and directory
// synced) before PrepareRootDisk returns, so its existence can be trusted.
func (b *Backend) PrepareRootDisk(ctx context.Context, dst, base string, sizeGB int64) error {
	if sizeGB <= 0 {
		return permanent.Errorf("qemu: root disk size must be positive, got %d GiB", sizeGB)
	}
	img, err := b.imgBinary()
	if err != nil {
		return err
	}
	if _, err := os.Stat(dst); err == nil {
		if format, ferr := diskFormat(dst); ferr == nil && format == "qcow2" {
			b.log.Debug("root disk exists, keeping it", "path", dst)
			return nil
		}
		b.log.Warn("root disk exists but is no qcow2 image (torn by a crash?); making it again", "path", dst)
		if err := os.Remove(dst); err != nil {
			return fmt.Errorf("qemu: root disk: %w", err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("qemu: root disk: %w", err)
	}
	base, err = filepath.Abs(base)
	if err != nil {
		return fmt.Errorf("qemu: base image: %w", err)
	}
	fi, err := os.Stat(base)
	if err != nil {
		return fmt.Errorf("qemu: base image: %w", err)
	}
	size := sizeGB << 30
	if fi.Size() > size {
		return permanent.Errorf("qemu: disk of %d GiB is smaller than the image (%d bytes)", sizeGB, fi.Size())
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return fmt.Errorf("qemu: root disk dir: %w", err)
	}
	dst, err = filepath.Abs(dst)
	if err != nil {
		return fmt.Errorf("qemu: root disk: %w", err)
	}

	backing := base
	pin := dst + ".base"
	_ = os.Remove(pin)
	if err := os.Link(base, pin); err == nil {
		backing = pin
	} else {
		b.log.Debug("cannot pin base image with a hard link; overlay references it directly", "base", base, "err", err)
	}

	tmp := dst + ".tmp"
	_ = os.Remove(tmp)
	cmd := exec.CommandContext(ctx, img, "create", "-q", "-f", "qcow2", "-F", "raw", "-b", backing, tmp, strconv.FormatInt(size, 10))
	if out, err := cmd.CombinedOutput(); err != nil {
		_ = os.Remove(tmp)
		if backing == pin {
			_ = os.Remove(pin)
		}
		return fmt.Errorf("qemu-img create: %w: %s", err, bytes.TrimSpace(out))
	}
	// qemu-img does not sync what it writes: without this a power loss
	// could leave a dst that exists but is empty.
	if err := syncPath(tmp); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("qemu: root disk: %w", err)
	}
	if err := os.Rename(tmp, dst); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("qemu: root disk: %w", err)
	}
	// The rename and the pin's link are entries of one directory.
	if err := syncPath(filepath.Dir(dst)); err != nil {
		return fmt.Errorf("qemu: root disk: %w", err)
	}
	b.log.Debug("root disk prepared", "path", dst, "base", base, "size_gb", sizeGB)
	return nil
}

// fsync is (*os.File).Sync; a test swaps it to see what is synced.
var fsync = (*os.File).Sync

// syncPath flushes a file, or a directory's entries, to disk.
func syncPath(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return fsync(f)
}

// diskFormat tells qcow2 from raw by the qcow2 magic, so QEMU never has to
// guess (guessing raw is refused for writable disks).
func diskFormat(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	magic := make([]byte, 4)
	if _, err := io.ReadFull(f, magic); err == nil && string(magic) == "QFI\xfb" {
		return "qcow2", nil
	}
	return "raw", nil
}
