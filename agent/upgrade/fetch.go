package upgrade

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
)

// fetch downloads url into path, resuming from what path already holds: a
// download cut off halfway (a restart, a dropped connection) goes on where
// it stopped. The file never grows past size. progress is told the bytes
// held after each write.
func fetch(ctx context.Context, client *http.Client, url, credential, path string, size int64, progress func(done int64)) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	have, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return err
	}
	if have > size {
		// Not a prefix of this build: start over.
		if err := f.Truncate(0); err != nil {
			return err
		}
		have, _ = f.Seek(0, io.SeekStart)
	}
	if have == size {
		return nil
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+credential)
	if have > 0 {
		req.Header.Set("Range", "bytes="+strconv.FormatInt(have, 10)+"-")
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusPartialContent:
	case http.StatusOK:
		// The server sent it all: what was held is replaced.
		if err := f.Truncate(0); err != nil {
			return err
		}
		if have, err = f.Seek(0, io.SeekStart); err != nil {
			return err
		}
	default:
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("download: %s: %s", resp.Status, b)
	}
	progress(have)
	buf := make([]byte, 256<<10)
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			if have+int64(n) > size {
				return errors.New("download: the control plane sent more than the build's size")
			}
			if _, err := f.Write(buf[:n]); err != nil {
				return err
			}
			have += int64(n)
			progress(have)
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return rerr
		}
	}
	if have != size {
		return fmt.Errorf("download: got %d of %d bytes", have, size)
	}
	return f.Sync()
}
