package cluster

import (
	"reflect"
	"slices"
	"testing"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

var (
	someTime = hlc.Timestamp{Wall: 1795890746000, Counter: 3, Node: "n1"}
	someCall = callReq{Op: opSubmit, Group: 7, Relay: true, After: someTime, Key: []byte("k"),
		Cmd: store.Command{Op: store.OpSet, Cond: store.Cond(2), Key: []byte("key"), Value: []byte("value"), Version: someTime,
			Now: 1795890746001, TTL: -5, Fence: hlc.Timestamp{Wall: 9, Counter: 1 << 60, Node: "n2"}, Expected: hlc.Timestamp{Wall: -1},
			Request: []byte("client\x00corr"), Keep: 10_000}}
	someReply = callResp{Kind: errDiskFull, Err: "full", Leader: "n3", Found: true,
		Result:   store.Result{Outcome: store.NotApplied, Version: someTime, Previous: []byte("old"), HadPrevious: true, Repeated: true},
		Entry:    store.Entry{Key: []byte("k"), Value: []byte("v"), Version: someTime, Fence: someTime, ExpiresAt: 1 << 40},
		DiskFull: &replica.DiskFullError{Dir: "/d", Free: 1, Reserve: 2}}
)

// TestCallCodecRoundTrip: the binary forms give back every field they
// carry, and a reply to any call reads as sent.
func TestCallCodecRoundTrip(t *testing.T) {
	for _, req := range []callReq{someCall, {Op: opGet, Group: 1, Key: []byte("x")}, {Op: opSubmit, Cmd: store.Command{Op: store.OpVDel, Key: []byte("k"), Value: []byte("v")}}} {
		var got callReq
		bin, err := decodeCall(appendCall(nil, &req), &got)
		if !bin || err != nil || !reflect.DeepEqual(got, req) {
			t.Fatalf("call: %v %v\n got %+v\nwant %+v", bin, err, got, req)
		}
	}
	for _, resp := range []callResp{someReply, {}, {Kind: errNotLeader, Leader: "n2"}} {
		var got callResp
		if err := decodeReply(appendReply(nil, &resp), &got); err != nil || !reflect.DeepEqual(got, resp) {
			t.Fatalf("reply: %v\n got %+v\nwant %+v", err, got, resp)
		}
	}
	// msgpack, as a node before protocol 2 sends, reads too.
	body, _ := peer.Encode(someCall)
	var got callReq
	if bin, err := decodeCall(body, &got); bin || err != nil || !reflect.DeepEqual(got, someCall) {
		t.Fatalf("msgpack call: %v %v %+v", bin, err, got)
	}
	body, _ = peer.Encode(someReply)
	var gotResp callResp
	if err := decodeReply(body, &gotResp); err != nil || !reflect.DeepEqual(gotResp, someReply) {
		t.Fatalf("msgpack reply: %v %+v", err, gotResp)
	}
	// Only forwarded writes and reads have the binary form.
	for op := opSubmit; op <= opMembership; op++ {
		if binaryCall(&callReq{Op: op}) != (op == opSubmit || op == opGet) {
			t.Fatalf("op %d: binary %v", op, binaryCall(&callReq{Op: op}))
		}
	}
}

// TestCallCodecKnowsEveryField fails when a field is added to a message
// the binary forms carry: decide whether the form carries it (and extend
// it) or not (a field opSubmit and opGet never set), then list it here.
func TestCallCodecKnowsEveryField(t *testing.T) {
	check := func(v any, carried, not []string) {
		t.Helper()
		typ := reflect.TypeOf(v)
		for i := range typ.NumField() {
			f := typ.Field(i)
			if f.IsExported() && !slices.Contains(carried, f.Name) && !slices.Contains(not, f.Name) {
				t.Errorf("%s.%s: is it in the binary form? (callcodec.go)", typ.Name(), f.Name)
			}
		}
	}
	check(callReq{}, []string{"Op", "Group", "Cmd", "After", "Key", "Relay"},
		[]string{"From", "Prefix", "Limit", "Meta", "Since", "FromStart", "AnyReplica", "Copy"})
	check(store.Command{}, []string{"Op", "Cond", "Key", "Value", "Version", "Now", "TTL", "Fence", "Expected", "Request", "Keep", "Delta"}, nil)
	check(hlc.Timestamp{}, []string{"Wall", "Counter", "Node"}, nil)
	check(callResp{}, []string{"Kind", "Err", "Leader", "Result", "Entry", "Found", "DiskFull"},
		[]string{"LeaderAddr", "Entries", "Exhausted", "Applied", "Servers", "Committed", "Status", "Events", "Last",
			"Snapshot", "Holder", "Inc", "Leads", "Keys", "MaxVersion", "Floor", "HasFloor", "More", "Member", "Gone", "VolumeFull", "MQTT", "MQTTAddr", "ServerKeys"})
	check(store.Result{}, []string{"Outcome", "Version", "Previous", "HadPrevious", "Repeated"}, nil)
	check(store.Entry{}, []string{"Key", "Value", "Version", "Fence", "ExpiresAt"}, nil)
	check(replica.DiskFullError{}, []string{"Dir", "Free", "Reserve"}, nil)
}

// FuzzCallCodec: any input decodes to an error or to a call (a reply)
// whose binary form reads back the same; nothing panics.
func FuzzCallCodec(f *testing.F) {
	f.Add(appendCall(nil, &someCall))
	f.Add(appendCall(nil, &callReq{Op: opGet, Key: []byte("k")}))
	f.Add(appendReply(nil, &someReply))
	f.Add(appendReply(nil, &callResp{}))
	f.Add([]byte{binCall})
	f.Add([]byte{binReply, 0, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		var req callReq
		if bin, err := decodeCall(b, &req); bin && err == nil {
			var again callReq
			if _, err := decodeCall(appendCall(nil, &req), &again); err != nil || !reflect.DeepEqual(again, req) {
				t.Fatalf("call %x: read back %v %+v, want %+v", b, err, again, req)
			}
		}
		var resp callResp
		if len(b) > 0 && b[0] == binReply && decodeReply(b, &resp) == nil {
			var again callResp
			if err := decodeReply(appendReply(nil, &resp), &again); err != nil || !reflect.DeepEqual(again, resp) {
				t.Fatalf("reply %x: read back %v %+v, want %+v", b, err, again, resp)
			}
		}
	})
}

func BenchmarkCallCodec(b *testing.B) {
	req := callReq{Op: opSubmit, Group: 3, Cmd: store.Command{Op: store.OpSet, Key: []byte("k1234"), Value: make([]byte, 256)}, After: someTime}
	resp := callResp{Result: store.Result{Outcome: store.Applied, Version: someTime}}
	b.Run("msgpack", func(b *testing.B) {
		for b.Loop() {
			body, _ := peer.Encode(req)
			var r callReq
			peer.Decode(body, &r)
			body, _ = peer.Encode(resp)
			var p callResp
			peer.Decode(body, &p)
		}
	})
	b.Run("binary", func(b *testing.B) {
		for b.Loop() {
			var r callReq
			decodeCall(appendCall(nil, &req), &r)
			var p callResp
			decodeReply(appendReply(nil, &resp), &p)
		}
	})
}
