package attach

import (
	"reflect"
	"testing"

	"github.com/mqkv/mqkv/internal/statestore"
)

func someKeyNotify() *statestore.Request {
	return &statestore.Request{ClientID: "alice", Payload: []byte("*3\r\n$9\r\nKEYNOTIFY\r\n$1\r\nk\r\n$4\r\nSTOP\r\n"),
		ResponseTopic: "clients/alice/reply", CorrelationData: []byte("0123456789abcdef"), QoS: 1, MessageExpiry: 10,
		Timestamp: "1795890746000:00000:x", HasTimestamp: true}
}

// TestForwardedRoundTrip: a forwarded KEYNOTIFY reads back as sent; what
// is not one is refused.
func TestForwardedRoundTrip(t *testing.T) {
	want := someKeyNotify()
	got, ok := decodeForwarded(appendForwarded(nil, want))
	if !ok || !reflect.DeepEqual(forwardedOf(got), forwardedOf(want)) {
		t.Fatalf("read back %v %+v", ok, forwardedOf(got))
	}
	set := someKeyNotify()
	set.Payload = []byte("*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n")
	anon := someKeyNotify()
	anon.ClientID = ""
	for _, r := range []*statestore.Request{set, anon} {
		if _, ok := decodeForwarded(appendForwarded(nil, r)); ok {
			t.Fatalf("%q from %q forwarded", r.Payload, r.ClientID)
		}
	}
}

// FuzzDecodeForwarded: no body from the node link panics the decoder, and
// what it accepts is a KEYNOTIFY that reads back the same.
func FuzzDecodeForwarded(f *testing.F) {
	f.Add(appendForwarded(nil, someKeyNotify()))
	f.Add([]byte{forwardMark})
	f.Add([]byte{forwardMark, 0x81, 0xa1, 'x', 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, ok := decodeForwarded(b)
		if !ok {
			return
		}
		again, ok := decodeForwarded(appendForwarded(nil, r))
		if !ok || !reflect.DeepEqual(forwardedOf(again), forwardedOf(r)) {
			t.Fatalf("read back %v %+v, want %+v", ok, forwardedOf(again), forwardedOf(r))
		}
	})
}
