package journal

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
)

// sealsFile, beside the segments, records how each finished segment ends.
// A segment reads the same whether it was cut by a crash or by damage
// exactly at the end of a batch: without the file, an old segment cut
// short or zeroed from a batch on opened without a word, and a quiet
// group's acknowledged entries were gone (found by review). Only the
// newest segment, still written, is not sealed: a cut there cannot be told
// from a torn write.
//
// It is a file of its own rather than records in the segments, so that a
// release before it reads the segments as ever and ignores it; and it
// holds only what such a release cannot make untrue (it never writes a
// finished segment again). That is why it does not record which segment
// is the oldest kept: a release before it removes old segments without
// saying so, and a floor it left behind refused a journal after going back
// one release and forth again (found by review); an oldest segment
// removed by hand is not detected. Lines: "seg SEQ SIZE" (segment SEQ ends
// at byte SIZE).
const sealsFile = "seals"

// seals is what sealsFile holds: the size of each finished segment.
type seals map[uint64]int64

// readSeals reads dir's seals; none if there is no file (a journal of a
// release before it, or one that has finished no segment yet).
func readSeals(dir string) (seals, error) {
	s := seals{}
	path := filepath.Join(dir, sealsFile)
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return s, err
	}
	for i, line := range bytes.Split(bytes.TrimSpace(data), []byte("\n")) {
		f := bytes.Fields(line)
		var err error
		switch {
		case len(f) == 2 && string(f[0]) == "floor":
			// Written by a version of this file for a while: ignored.
		case len(f) == 3 && string(f[0]) == "seg":
			var seq uint64
			var size int64
			if seq, err = strconv.ParseUint(string(f[1]), 10, 64); err == nil {
				size, err = strconv.ParseInt(string(f[2]), 10, 64)
				s[seq] = size
			}
		default:
			err = errors.New("not a seal")
		}
		if err != nil {
			return s, &DamagedError{Path: path, Off: int64(i), Err: fmt.Errorf("line %d: %q: %v", i+1, line, err)}
		}
	}
	return s, nil
}

// writeSeals replaces dir's seals, durably.
func writeSeals(dir string, s seals) error {
	var b bytes.Buffer
	seqs := make([]uint64, 0, len(s))
	for seq := range s {
		seqs = append(seqs, seq)
	}
	slices.Sort(seqs)
	for _, seq := range seqs {
		fmt.Fprintf(&b, "seg %d %d\n", seq, s[seq])
	}
	if err := WriteFileSync(dir, sealsFile, b.Bytes(), 0o600); err != nil {
		return fmt.Errorf("journal: seals: %w", err)
	}
	return nil
}

// checkSeals compares the segments read (oldest first, the last one
// written) with their seals.
func (j *Journal) checkSeals() error {
	if len(j.segs) == 0 {
		return nil
	}
	for _, s := range j.segs[:len(j.segs)-1] {
		if size, ok := j.seals[s.seq]; ok && s.size != size {
			return &DamagedError{Path: filepath.Join(j.dir, segName(s.seq)), Off: s.size,
				Err: fmt.Errorf("its records end at byte %d; it was finished at byte %d", s.size, size)}
		}
	}
	return nil
}
