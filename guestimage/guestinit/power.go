//go:build linux

package main

import (
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Linux input event constants (linux/input-event-codes.h).
const (
	evKey    = 0x01
	keyPower = 116
	// struct input_event on 64-bit: struct timeval (16) + type, code (2+2) + value (4).
	inputEventSize = 24
)

// watchPowerButton powers the guest off when the ACPI power button is pressed
// (QMP system_powerdown). The kernel's ACPI button driver reports the press
// as KEY_POWER on an evdev device; nothing else in this guest would act on it.
func watchPowerButton() {
	seen := map[string]bool{}
	// The button device is registered shortly after its module loads; look a
	// few times rather than assume it is there already.
	for i := 0; i < 50; i++ {
		devs, _ := filepath.Glob("/dev/input/event*")
		for _, d := range devs {
			if seen[d] || !isPowerButton(d) {
				continue
			}
			seen[d] = true
			go readPowerEvents(d)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if len(seen) == 0 {
		slog.Warn("no power button input device; ACPI shutdown will not work")
	}
}

func isPowerButton(dev string) bool {
	name, err := os.ReadFile(filepath.Join("/sys/class/input", filepath.Base(dev), "device/name"))
	return err == nil && strings.Contains(strings.ToLower(string(name)), "power button")
}

func readPowerEvents(dev string) {
	f, err := os.Open(dev)
	if err != nil {
		slog.Warn("open input", "dev", dev, "err", err)
		return
	}
	defer f.Close()
	buf := make([]byte, inputEventSize)
	for {
		if _, err := io.ReadFull(f, buf); err != nil {
			slog.Warn("read input", "dev", dev, "err", err)
			return
		}
		typ := binary.LittleEndian.Uint16(buf[16:])
		code := binary.LittleEndian.Uint16(buf[18:])
		val := int32(binary.LittleEndian.Uint32(buf[20:]))
		if typ == evKey && code == keyPower && val == 1 {
			powerOff("power button")
		}
	}
}

// watchSignals treats the signals a kernel or operator sends init to ask for a
// shutdown the same way as the power button.
func watchSignals() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, unix.SIGPWR, unix.SIGTERM, unix.SIGINT)
	s := <-ch
	powerOff("signal " + s.String())
}

func powerOff(why string) {
	fmt.Fprintf(os.Stdout, "EITRI-GUEST-POWEROFF reason=%q\n", why)
	unix.Sync()
	if err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
		slog.Error("power off", "err", err)
	}
	select {}
}
