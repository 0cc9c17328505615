//go:build !linux

package journal

import "os"

func Datasync(f *os.File) error { return f.Sync() }
