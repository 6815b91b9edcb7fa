package qemu

import (
	"os"
	"regexp"
	"strings"
)

// serialTailBytes bounds how much of the serial log SerialTail reads.
const serialTailBytes = 64 << 10

var ansiEscape = regexp.MustCompile(`\x1b(\[[0-9;?]*[ -/]*[@-~]|[@-Z\\-_])`)

// SerialTail returns the last lines of the VM's serial console, cleaned of
// terminal escapes and carriage returns, for explaining a failed boot.
// It is empty when there is no log.
func (b *Backend) SerialTail(id string, lines int) string {
	if checkID(id) != nil || lines <= 0 {
		return ""
	}
	return fileTail(b.serialPath(id), lines)
}

// qemuLogLines bounds how much of QEMU's own log explains a failure.
const qemuLogLines = 40

// qemuLog is the last lines QEMU wrote to its stderr (the -D log).
func (b *Backend) qemuLog(id string) string { return fileTail(b.logPath(id), qemuLogLines) }

func fileTail(path string, lines int) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(fi.Size()-serialTailBytes, 0)
	buf := make([]byte, fi.Size()-off)
	n, _ := f.ReadAt(buf, off)
	return tailLines(buf[:n], lines, off > 0)
}

func tailLines(buf []byte, lines int, truncated bool) string {
	text := ansiEscape.ReplaceAllString(string(buf), "")
	text = strings.ReplaceAll(text, "\r\n", "\n")
	text = strings.Map(func(r rune) rune {
		if r == '\n' || r == '\t' || (r >= ' ' && r != 0x7f) {
			return r
		}
		return -1
	}, text)
	all := strings.Split(strings.TrimRight(text, "\n"), "\n")
	if truncated && len(all) > 0 {
		all = all[1:] // the first line was cut by the read offset
	}
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}
