// Command mqkv is the mqkv binary: an MQTT v5 broker with a built-in,
// durable state store (`mqkv serve`, the default), and the tools that talk
// to one: get, set, del, vdel, watch, lock, status, top, backup, restore,
// bench and passwd.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

// exitCode ends the process with a code other than 0 without printing
// anything more: the command has said what there is to say.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

func main() {
	root := &cobra.Command{
		Use:   "mqkv",
		Short: "An MQTT v5 broker with a durable, AIO-compatible state store",
		Long: `mqkv is an MQTT v5 broker with a built-in, durable key-value state store
that speaks the Azure IoT Operations state store protocol.

Without a command it runs the server (mqkv serve).`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	serve := serveCmd()
	root.RunE = serve.RunE
	root.Flags().AddFlagSet(serve.Flags())
	root.AddCommand(serve, attachCmd(), benchCmd(), passwdCmd())
	root.AddCommand(kvCmds()...)
	root.AddCommand(pubCmd(), subCmd())
	root.AddCommand(statusCmd(), topCmd(), backupCmd(), restoreCmd(), clusterCmd(), versionCmd())
	root.Version = versionString()
	root.SetVersionTemplate("{{.Version}}\n")
	err := root.Execute()
	var code exitCode
	switch {
	case err == nil:
	case errors.As(err, &code):
		os.Exit(int(code))
	default:
		fmt.Fprintln(os.Stderr, "mqkv:", err)
		os.Exit(2)
	}
}
