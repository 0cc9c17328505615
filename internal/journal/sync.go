package journal

import (
	"os"
	"path/filepath"
)

// SyncDir makes a file created, renamed or removed in dir durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// WriteFileSync replaces the file name in dir with data, durably and whole:
// a temporary file is written and synced, renamed over it, and the
// directory synced, so that a crash leaves the old content or the new.
func WriteFileSync(dir, name string, data []byte, perm os.FileMode) error {
	path := filepath.Join(dir, name)
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return SyncDir(dir)
}
