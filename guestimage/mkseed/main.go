// Command mkseed writes a NoCloud seed ISO for booting the test guest by hand:
//
//	go run ./guestimage/mkseed -out seed.iso -hostname demo -instance-id i-1
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/a73x/eitri/agent/seed"
)

func main() {
	out := flag.String("out", "seed.iso", "where to write the seed image")
	host := flag.String("hostname", "eitri-demo", "guest hostname (one DNS label)")
	id := flag.String("instance-id", "i-demo", "cloud-init instance id")
	key := flag.String("authorized-key", "", "optional authorized_keys line")
	flag.Parse()
	p := seed.Params{InstanceID: *id, Hostname: *host, SSHAuthorizedKey: *key}
	if err := seed.Write(*out, p); err != nil {
		fmt.Fprintln(os.Stderr, "mkseed:", err)
		os.Exit(1)
	}
}
