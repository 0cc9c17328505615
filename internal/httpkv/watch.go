package httpkv

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/statestore"
	"github.com/mqkv/mqkv/internal/store"
)

// DefaultWatchBuffer is how many changes a watch holds for a client that
// reads slower than they come (Config.WatchBuffer); past it the stream
// ends with an "overflow" event and the client resumes from its last event
// id (EventSource does so by itself), replayed from the change history.
const DefaultWatchBuffer = 4096

// keepAliveEvery is how often an idle stream gets a comment, so that
// proxies and clients see it alive.
var keepAliveEvery = 15 * time.Second

// watchEvent is an event's data.
type watchEvent struct {
	Key         string `json:"key"`
	Value       string `json:"value,omitempty"`
	ValueBase64 string `json:"value_base64,omitempty"`
	Version     string `json:"version"`
}

// watch serves GET /v1/watch/{key} and /v1/watch/?match=glob as
// server-sent events: one per change, "set" or "delete", with the version
// as its id. Last-Event-ID (or ?since=version) resumes after that version
// from the change history (KEYNOTIFY ... SINCE); if the history no longer
// reaches back, a "truncated" event says so (read the keys again) and the
// stream goes on live.
func (s *Server) watch(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		fail(w, http.StatusMethodNotAllowed, "method_not_allowed", "a watch is a GET")
		return
	}
	c := s.client(w, r)
	if c == nil {
		return
	}
	defer c.Close()
	key, err := keyAfter(r, "/v1/watch/")
	if err != nil {
		fail(w, http.StatusBadRequest, "bad_request", "the key is not percent-encoded correctly")
		return
	}
	args := [][]byte{[]byte("KEYNOTIFY"), key}
	if m := r.URL.Query().Get("match"); m != "" {
		if len(key) != 0 {
			fail(w, http.StatusBadRequest, "bad_request", "watch a key or ?match=glob, not both")
			return
		}
		args = [][]byte{[]byte("KEYNOTIFY"), []byte(m), []byte("PATTERN")}
	} else if len(key) == 0 {
		fail(w, http.StatusBadRequest, "bad_request", "name a key (/v1/watch/{key}) or a glob (?match=)")
		return
	}
	since := r.Header.Get("Last-Event-ID")
	if q := r.URL.Query().Get("since"); q != "" {
		since = q
	}
	if since != "" {
		if _, err := hlc.Parse(since); err != nil {
			fail(w, http.StatusBadRequest, "bad_request", "Last-Event-ID (or since) is not a version")
			return
		}
	}
	flusher, ok := w.(http.Flusher)
	if !ok {
		fail(w, http.StatusInternalServerError, "internal", "streaming is not supported here")
		return
	}
	events := make(chan store.Event, s.cfg.WatchBuffer)
	// overflow: the client read slower than changes came; lost: changes
	// were lost to this node (a cluster member that fell behind). Either
	// ends the watch once what came before is written.
	var overflow, lost atomic.Bool
	wake := make(chan struct{}, 1)
	gap := func() {
		lost.Store(true)
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	notify := func(ev store.Event) bool {
		if overflow.Load() || lost.Load() {
			return false
		}
		ev.Key, ev.Value = bytes.Clone(ev.Key), bytes.Clone(ev.Value)
		select {
		case events <- ev:
			return true
		default:
			overflow.Store(true)
			return false
		}
	}
	truncated := false
	register := args
	if since != "" {
		register = append(register[:len(register):len(register)], []byte("SINCE"), []byte(since))
	}
	v := c.Watch(register, notify, gap)
	if v.Kind == resp.ErrorReply && string(v.Str) == string(statestore.ErrHistoryTruncated) {
		truncated = true
		v = c.Watch(args, notify, gap)
	}
	if v.Kind == resp.ErrorReply {
		storeFail(w, v)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	if truncated {
		w.Write([]byte("event: truncated\ndata: {\"message\":\"the change history no longer reaches back to Last-Event-ID: read the keys again\"}\n\n"))
	}
	flusher.Flush()
	tick := time.NewTicker(keepAliveEvery)
	defer tick.Stop()
	var buf []byte
	for {
		select {
		case <-r.Context().Done():
			return
		case <-wake:
		case <-tick.C:
			if _, err := w.Write([]byte(": keep-alive\n\n")); err != nil {
				return
			}
			flusher.Flush()
		case ev := <-events:
			buf = appendEvent(buf[:0], ev)
			for more := true; more && len(buf) < 64<<10; { // what else waits goes in the same write
				select {
				case ev := <-events:
					buf = appendEvent(buf, ev)
				default:
					more = false
				}
			}
			if _, err := w.Write(buf); err != nil {
				return
			}
			flusher.Flush()
		}
		if lost.Load() && len(events) == 0 {
			// Not resumable: a SINCE is answered "truncated" where
			// changes could be missing.
			w.Write([]byte("event: truncated\ndata: {\"message\":\"changes were lost to this server (a cluster member that fell behind): read the keys again\"}\n\n"))
			flusher.Flush()
			return
		}
		if overflow.Load() && len(events) == 0 {
			w.Write([]byte("event: overflow\ndata: {\"message\":\"this client read slower than changes came: reconnect with Last-Event-ID to resume\"}\n\n"))
			flusher.Flush()
			return
		}
	}
}

// appendEvent renders one change as a server-sent event.
func appendEvent(b []byte, ev store.Event) []byte {
	data := watchEvent{Key: string(ev.Key), Version: ev.Version.String()}
	kind := "delete"
	if ev.Kind == store.EventSet {
		kind = "set"
		if utf8.Valid(ev.Value) {
			data.Value = string(ev.Value)
		} else {
			data.ValueBase64 = base64.StdEncoding.EncodeToString(ev.Value)
		}
	}
	js, _ := json.Marshal(data) // one line: JSON escapes newlines
	b = append(b, "id: "...)
	b = append(b, data.Version...)
	b = append(b, "\nevent: "...)
	b = append(b, kind...)
	b = append(b, "\ndata: "...)
	b = append(b, js...)
	return append(b, "\n\n"...)
}

// keyAfter reads the key in r's path after prefix, percent-decoded.
func keyAfter(r *http.Request, prefix string) ([]byte, error) {
	return unescapeKey(strings.TrimPrefix(r.URL.EscapedPath(), prefix))
}
