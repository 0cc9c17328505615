// Command mqkv is the mqkv binary: an MQTT v5 broker with a built-in,
// durable state store (`mqkv serve`, the default), and the tools that talk
// to one (`mqkv bench`).
package main

import (
	"fmt"
	"os"
)

const usage = `mqkv: an MQTT v5 broker with a durable, AIO-compatible state store.

Usage:
  mqkv [serve] [flags]    run the server (the default)
  mqkv bench [flags]      measure a server's throughput and latency
  mqkv passwd FILE USER   add or change a user in a password file

Run "mqkv <command> -h" for the flags of a command.
`

func main() {
	args := os.Args[1:]
	cmd := "serve"
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		cmd, args = args[0], args[1:]
	}
	var err error
	switch cmd {
	case "serve":
		err = serve(args)
	case "bench":
		err = runBench(args)
	case "passwd":
		err = passwd(args)
	case "help", "-h", "--help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "mqkv: unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mqkv:", err)
		os.Exit(1)
	}
}
