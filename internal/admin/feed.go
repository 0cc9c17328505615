package admin

import (
	"bytes"
	"encoding/hex"
	"sync"
	"unicode/utf8"

	"github.com/mqkv/mqkv/internal/store"
)

// Change is a key change as the console shows it.
type Change struct {
	Op       string `json:"op"` // SET or DELETE
	Key      string `json:"key"`
	KeyHex   string `json:"key_hex"`
	Value    string `json:"value,omitempty"`
	ValueHex string `json:"value_hex,omitempty"`
	Binary   bool   `json:"binary,omitempty"` // the value is not UTF-8
	Version  string `json:"version"`
}

// feed fans applied changes out to live viewers. It never blocks the apply
// path: a viewer that falls behind misses changes (and is told so).
// Changes are formatted for display only when someone watches: the last
// ones are kept as the events they are (the apply path hands over events
// it will not change), since formatting every write cost about 7 % of a
// durable SET's CPU on a server nobody was watching.
type feed struct {
	mu     sync.Mutex
	subs   map[chan Change]struct{}
	recent []store.Event // the last changes, for a viewer that just arrived; up to 2*feedRecent
}

const (
	feedRecent = 50
	// maxViewers bounds the live views open at once: each holds a
	// goroutine, a buffer and a connection.
	maxViewers = 32
)

func newFeed() *feed { return &feed{subs: map[chan Change]struct{}{}} }

// Events is a replica OnEvents consumer.
func (f *feed) Events(events []store.Event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	kept := events
	if len(kept) > feedRecent {
		kept = kept[len(kept)-feedRecent:]
	}
	if len(f.recent)+len(kept) > 2*feedRecent {
		// Slide the newest down to the front: an amortised copy, and
		// the array never grows past 2*feedRecent.
		n := copy(f.recent, f.recent[len(f.recent)-(feedRecent-len(kept)):])
		f.recent = f.recent[:n]
	}
	start := len(f.recent)
	f.recent = append(f.recent, kept...)
	for i := start; i < len(f.recent); i++ {
		if v := f.recent[i].Value; len(v) > valuePreview {
			// Only the preview is shown: kept whole, a large value
			// would stay in memory after the key moved on.
			f.recent[i].Value = bytes.Clone(v[:valuePreview])
		}
	}
	if len(f.subs) == 0 {
		return
	}
	for i := range events {
		c := changeOf(&events[i])
		for ch := range f.subs {
			select {
			case ch <- c:
			default: // slow viewer: drop
			}
		}
	}
}

// changeOf formats an event for the console.
func changeOf(e *store.Event) Change {
	c := Change{Op: "SET", Key: printable(e.Key), KeyHex: hex.EncodeToString(e.Key), Version: e.Version.String()}
	if e.Kind == store.EventDelete {
		c.Op = "DELETE"
	} else {
		c.Value, c.ValueHex, c.Binary = valueForms(e.Value)
	}
	return c
}

// subscribe adds a viewer; ok is false when maxViewers are already open.
func (f *feed) subscribe() (ch chan Change, recent []Change, ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.subs) >= maxViewers {
		return nil, nil, false
	}
	ch = make(chan Change, 256)
	f.subs[ch] = struct{}{}
	last := f.recent[max(0, len(f.recent)-feedRecent):]
	recent = make([]Change, len(last))
	for i := range last {
		recent[i] = changeOf(&last[i])
	}
	return ch, recent, true
}

func (f *feed) unsubscribe(ch chan Change) {
	f.mu.Lock()
	delete(f.subs, ch)
	f.mu.Unlock()
}

const valuePreview = 4096 // bytes of a value the console shows

// valueForms returns a value as text (if UTF-8) and hex, cut to a preview.
func valueForms(v []byte) (text, hexForm string, binary bool) {
	if len(v) > valuePreview {
		v = v[:valuePreview]
	}
	return printable(v), hex.EncodeToString(v), !utf8.Valid(v)
}

// printable returns b as a string with invalid UTF-8 replaced, for display.
func printable(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	out := make([]rune, 0, len(b))
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		out = append(out, r)
		b = b[n:]
	}
	return string(out)
}
