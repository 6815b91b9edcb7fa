// Command icbench drives agent/imagecache for compare.sh: it serves files on
// loopback, fetches one through a Cache, or decodes a qcow2, and prints the
// wall time in seconds.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"runtime/pprof"
	"time"

	"github.com/a73x/eitri/agent/imagecache"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: icbench serve|fetch|decode ...")
		os.Exit(2)
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	dir := fs.String("dir", "", "directory (serve: to serve; fetch: cache dir)")
	url := fs.String("url", "", "fetch: image URL")
	sha := fs.String("sha", "", "fetch: sha256")
	in := fs.String("in", "", "decode: qcow2 input")
	out := fs.String("out", "", "decode: raw output")
	cpuprofile := fs.String("cpuprofile", "", "fetch, decode: write a CPU profile here")
	verbose := fs.Bool("v", false, "log at info level (the cache says how long each stage took)")
	_ = fs.Parse(os.Args[2:])
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})))
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		check(err)
		check(pprof.StartCPUProfile(f))
		defer pprof.StopCPUProfile()
	}

	switch os.Args[1] {
	case "serve":
		// Loopback only; prints the base URL and serves until killed.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		check(err)
		fmt.Printf("http://%s\n", ln.Addr())
		check(http.Serve(ln, http.FileServer(http.Dir(*dir))))
	case "fetch":
		start := time.Now()
		// The server is ours, on loopback, which the cache refuses unless told.
		loopback := imagecache.AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}
		_, err := imagecache.New(*dir, imagecache.WithDialPolicy(loopback)).Ensure(context.Background(), *url, *sha, nil)
		check(err)
		fmt.Printf("%.3f\n", time.Since(start).Seconds())
	case "decode":
		start := time.Now()
		src, err := os.Open(*in)
		check(err)
		fi, err := src.Stat()
		check(err)
		dst, err := os.Create(*out)
		check(err)
		check(imagecache.DecodeQcow2(context.Background(), src, fi.Size(), dst))
		check(dst.Close())
		fmt.Printf("%.3f\n", time.Since(start).Seconds())
	default:
		fmt.Fprintln(os.Stderr, "unknown command", os.Args[1])
		os.Exit(2)
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "icbench:", err)
		os.Exit(1)
	}
}
