package cluster

import (
	"bytes"
	"reflect"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

var (
	someAppend = raft.AppendEntriesRequest{
		RPCHeader: raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("n1"), Addr: []byte("127.0.0.1:7001")},
		Term:      9, Leader: []byte("127.0.0.1:7001"), PrevLogEntry: 1 << 40, PrevLogTerm: 8, LeaderCommitIndex: 1<<40 - 1,
		Entries: []*raft.Log{
			{Index: 1<<40 + 1, Term: 9, Type: raft.LogCommand, Data: []byte("set k v"), AppendedAt: time.Unix(0, 1795890746000000001)},
			{Index: 1<<40 + 2, Term: 9, Type: raft.LogConfiguration, Data: bytes.Repeat([]byte{0xff}, 300), Extensions: []byte("x")},
			{Index: 1<<40 + 3, Term: 9, Type: raft.LogNoop},
		},
	}
	someAppendReply = raft.AppendEntriesResponse{
		RPCHeader: raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("n2"), Addr: []byte("127.0.0.1:7002")},
		Term:      9, LastLog: 1<<40 + 3, Success: true, NoRetryBackoff: true,
	}
)

// TestAppendCodecRoundTrip: the AppendEntries of several groups and their
// answers read back as sent, field for field, with the entries' data in
// memory of their own.
func TestAppendCodecRoundTrip(t *testing.T) {
	reqs := []groupAppend{{metaGroup, &someAppend}, {0, &raft.AppendEntriesRequest{Term: 1, RPCHeader: raft.RPCHeader{Addr: []byte("a")}}}, {7, &someAppend}}
	body := appendAppends(nil, reqs)
	size := 1
	for _, r := range reqs {
		size += appendSize(r.req)
	}
	if len(body) > size {
		t.Fatalf("%d bytes, more than appendSize's %d", len(body), size)
	}
	got, err := decodeAppends(body)
	if err != nil || len(got) != len(reqs) {
		t.Fatalf("%v: %d requests of %d", err, len(got), len(reqs))
	}
	for i := range reqs {
		if got[i].g != reqs[i].g || !sameAppend(got[i].req, reqs[i].req) {
			t.Fatalf("request %d: group %d\n got %+v\nwant %d %+v", i, got[i].g, got[i].req, reqs[i].g, reqs[i].req)
		}
	}
	got[0].req.Entries[0].Data[0] ^= 1
	if !bytes.Contains(body, []byte("set k v")) || got[2].req.Entries[0].Data[0] != 's' {
		t.Fatal("an entry's data shares memory")
	}
	answers := []appendAnswer{{resp: &someAppendReply}, {resp: &raft.AppendEntriesResponse{}}, {fault: "no replica", resp: &raft.AppendEntriesResponse{}}}
	back, err := decodeAppendReplies(appendAppendReplies(nil, answers))
	if err != nil || len(back) != len(answers) {
		t.Fatalf("answers: %v, %d of %d", err, len(back), len(answers))
	}
	for i := range answers {
		if back[i].fault != answers[i].fault || !reflect.DeepEqual(normal(*back[i].resp), normal(*answers[i].resp)) {
			t.Fatalf("answer %d:\n got %q %+v\nwant %q %+v", i, back[i].fault, back[i].resp, answers[i].fault, answers[i].resp)
		}
	}
	if back, err := decodeAppendReplies(appendAppendReplies(nil, []appendAnswer{{fault: "f"}})); err != nil || back[0].fault != "f" {
		t.Fatalf("an answer without a response: %v %+v", err, back)
	}
	// A heartbeat is told as raft's transport tells it.
	if !isHeartbeat(&raft.AppendEntriesRequest{Term: 2, RPCHeader: raft.RPCHeader{Addr: []byte("a")}}) || isHeartbeat(&someAppend) {
		t.Fatal("heartbeat told wrong")
	}
}

// sameAppend compares requests, times by their instant.
func sameAppend(a, b *raft.AppendEntriesRequest) bool {
	if len(a.Entries) != len(b.Entries) {
		return false
	}
	for i := range a.Entries {
		x, y := *a.Entries[i], *b.Entries[i]
		if !x.AppendedAt.Equal(y.AppendedAt) {
			return false
		}
		x.AppendedAt, y.AppendedAt = time.Time{}, time.Time{}
		if !reflect.DeepEqual(normalLog(x), normalLog(y)) {
			return false
		}
	}
	ac, bc := *a, *b
	ac.Entries, bc.Entries = nil, nil
	return reflect.DeepEqual(normalReq(ac), normalReq(bc))
}

// normal*: an empty byte slice and none read the same.
func normal(r raft.AppendEntriesResponse) raft.AppendEntriesResponse {
	r.ID, r.Addr = orNil(r.ID), orNil(r.Addr)
	return r
}

func normalReq(r raft.AppendEntriesRequest) raft.AppendEntriesRequest {
	r.ID, r.Addr, r.Leader = orNil(r.ID), orNil(r.Addr), orNil(r.Leader)
	return r
}

func normalLog(l raft.Log) raft.Log {
	l.Data, l.Extensions = orNil(l.Data), orNil(l.Extensions)
	return l
}

func orNil(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return b
}

// FuzzAppendCodec: any input decodes to an error or to requests (answers)
// whose binary form reads back the same; nothing panics, and a count the
// input cannot hold allocates nothing on its word.
func FuzzAppendCodec(f *testing.F) {
	f.Add(appendAppends(nil, []groupAppend{{3, &someAppend}, {4, &raft.AppendEntriesRequest{}}}))
	f.Add(appendAppends(nil, nil))
	f.Add(appendAppendReplies(nil, []appendAnswer{{resp: &someAppendReply}, {fault: "fault"}}))
	f.Add([]byte{binAppends, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte{binAppendReplies, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		if reqs, err := decodeAppends(b); err == nil {
			again, err := decodeAppends(appendAppends(nil, reqs))
			if err != nil || len(again) != len(reqs) {
				t.Fatalf("requests %x: read back %v, %d of %d", b, err, len(again), len(reqs))
			}
			for i := range reqs {
				if again[i].g != reqs[i].g || !sameAppend(again[i].req, reqs[i].req) {
					t.Fatalf("requests %x: %d read back %+v, want %+v", b, i, again[i], reqs[i])
				}
			}
		}
		if answers, err := decodeAppendReplies(b); err == nil {
			again, err := decodeAppendReplies(appendAppendReplies(nil, answers))
			if err != nil || len(again) != len(answers) {
				t.Fatalf("answers %x: read back %v, %d of %d", b, err, len(again), len(answers))
			}
			for i := range answers {
				if again[i].fault != answers[i].fault || !reflect.DeepEqual(normal(*again[i].resp), normal(*answers[i].resp)) {
					t.Fatalf("answers %x: %d read back %+v, want %+v", b, i, again[i], answers[i])
				}
			}
		}
	})
}
