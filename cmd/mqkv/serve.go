package main

import (
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/pprof"
	"strings"
	"syscall"

	"github.com/mqkv/mqkv/internal/server"
)

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:1883", "MQTT listener `address` (host:port; port 0 picks a free one)")
	dataDir := fs.String("data-dir", "./mqkv-data", "`directory` for the log, snapshots and MQTT sessions")
	inMemory := fs.Bool("in-memory", false, "keep everything in memory: nothing survives the process")
	logLevel := fs.String("log-level", "info", "log `level`: debug, info, warn, error")
	logFormat := fs.String("log-format", "text", "log `format`: text or json")
	cpuProfile := fs.String("cpu-profile", "", "write a CPU profile of the whole run to `file` (for performance work)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: mqkv serve [flags]\n\nRuns the MQTT broker and state store.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("serve: unexpected argument %q", fs.Arg(0))
	}
	logger, err := newLogger(os.Stderr, *logLevel, *logFormat)
	if err != nil {
		return err
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	srv, err := server.Start(server.Config{
		Listen:   *listen,
		DataDir:  *dataDir,
		InMemory: *inMemory,
		Logger:   logger,
	})
	if err != nil {
		return err
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	s := <-sig
	logger.Info("shutting down", "signal", s.String())
	return srv.Close()
}

func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: l}
	switch strings.ToLower(format) {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("log format %q: want text or json", format)
}
