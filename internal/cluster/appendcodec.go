package cluster

import (
	"encoding/binary"
	"time"

	"github.com/hashicorp/raft"
	"github.com/mqkv/mqkv/internal/peer"
)

// Raft's AppendEntries, the message a cluster sends most (every write
// goes to each follower of its group in one, and every heartbeat is one),
// have a binary form too, sent on the link's call streams (one per pair of
// nodes) instead of each group's raft streams in msgpack, and those of all
// the groups a node leads that go to one member at the same time travel
// together, in one message (see appender). Why: raft's network transport
// encodes and decodes by reflection, request and reply, on both nodes (a
// profile of a three-node cluster under SET load put about a ninth of its
// CPU there), and every AppendEntries was a round trip of its own: on the
// two-core machine a three-node cluster with 3 groups took about 30% less
// CPU per SET than with the default 8, its batches being larger.
//
// A node sends them once the cluster runs at protocolBinaryAppends (every
// member reads them); every other raft message (votes, snapshots,
// TimeoutNow) stays on the group's raft streams.
//
// binAppends: the number of requests (uvarint), then each: Group
// (uvarint), ProtocolVersion (uvarint), ID, Addr (bytes), Term (uvarint),
// Leader (bytes), PrevLogEntry, PrevLogTerm, LeaderCommitIndex (uvarints),
// the number of entries (uvarint), and each entry: Index, Term (uvarints),
// Type (byte), Data, Extensions (bytes), AppendedAt (varint, Unix
// nanoseconds; 0 for none).
//
// binAppendReplies: the number of answers (uvarint, as many as requests,
// in their order), then each: Err (string; empty when the follower's raft
// answered), ProtocolVersion (uvarint), ID, Addr (bytes), Term, LastLog
// (uvarints), flags (byte: bit 0 Success, 1 NoRetryBackoff).
const (
	binAppends       = 0x03
	binAppendReplies = 0x04
)

// protocolBinaryAppends is the cluster protocol from which members send
// binAppends.
const protocolBinaryAppends = 3

// groupAppend is one group's AppendEntries in a binAppends.
type groupAppend struct {
	g   uint32
	req *raft.AppendEntriesRequest
}

// appendAnswer is a follower's answer to one: resp, or the error it
// answered with (fault).
type appendAnswer struct {
	fault string
	resp  *raft.AppendEntriesResponse
}

// appendAppends appends a binAppends of reqs.
func appendAppends(b []byte, reqs []groupAppend) []byte {
	b = append(b, binAppends)
	b = binary.AppendUvarint(b, uint64(len(reqs)))
	for _, r := range reqs {
		b = appendAppend(b, r.g, r.req)
	}
	return b
}

// appendAppend appends group g's request req.
func appendAppend(b []byte, g uint32, req *raft.AppendEntriesRequest) []byte {
	b = binary.AppendUvarint(b, uint64(g))
	b = binary.AppendUvarint(b, uint64(req.ProtocolVersion))
	b = peer.AppendBytes(b, req.ID)
	b = peer.AppendBytes(b, req.Addr)
	b = binary.AppendUvarint(b, req.Term)
	b = peer.AppendBytes(b, req.Leader)
	b = binary.AppendUvarint(b, req.PrevLogEntry)
	b = binary.AppendUvarint(b, req.PrevLogTerm)
	b = binary.AppendUvarint(b, req.LeaderCommitIndex)
	b = binary.AppendUvarint(b, uint64(len(req.Entries)))
	for _, e := range req.Entries {
		b = binary.AppendUvarint(b, e.Index)
		b = binary.AppendUvarint(b, e.Term)
		b = append(b, byte(e.Type))
		b = peer.AppendBytes(b, e.Data)
		b = peer.AppendBytes(b, e.Extensions)
		var at int64
		if !e.AppendedAt.IsZero() {
			at = e.AppendedAt.UnixNano()
		}
		b = binary.AppendVarint(b, at)
	}
	return b
}

// appendSize is a bound on the size of req's binary form, for its buffer.
func appendSize(req *raft.AppendEntriesRequest) int {
	n := 64 + len(req.ID) + len(req.Addr) + len(req.Leader)
	for _, e := range req.Entries {
		n += 48 + len(e.Data) + len(e.Extensions)
	}
	return n
}

// decodeAppends reads a binAppends. The entries' data are copies: a log
// entry applied is kept (its value in the store), and must not hold the
// whole message's memory.
func decodeAppends(b []byte) ([]groupAppend, error) {
	if len(b) == 0 || b[0] != binAppends {
		return nil, errBadCall
	}
	r := peer.NewReader(b[1:])
	reqs := make([]groupAppend, r.Count(10))
	for i := range reqs {
		reqs[i] = readAppend(r)
	}
	if r.Bad() || r.Len() != 0 {
		return nil, errBadCall
	}
	return reqs, nil
}

func readAppend(r *peer.Reader) groupAppend {
	g := r.Uvarint()
	if g > metaGroup {
		r.Fail()
	}
	req := &raft.AppendEntriesRequest{}
	req.ProtocolVersion = raft.ProtocolVersion(r.Uvarint())
	req.ID = cloneBytes(r.Bytes())
	req.Addr = cloneBytes(r.Bytes())
	req.Term = r.Uvarint()
	req.Leader = cloneBytes(r.Bytes())
	req.PrevLogEntry = r.Uvarint()
	req.PrevLogTerm = r.Uvarint()
	req.LeaderCommitIndex = r.Uvarint()
	if n := r.Count(6); n > 0 {
		logs := make([]raft.Log, n)
		req.Entries = make([]*raft.Log, n)
		for i := range logs {
			e := &logs[i]
			e.Index = r.Uvarint()
			e.Term = r.Uvarint()
			e.Type = raft.LogType(r.Byte())
			e.Data = cloneBytes(r.Bytes())
			e.Extensions = cloneBytes(r.Bytes())
			if at := r.Varint(); at != 0 {
				e.AppendedAt = time.Unix(0, at)
			}
			req.Entries[i] = e
		}
	}
	return groupAppend{uint32(g), req}
}

// appendAppendReplies appends a binAppendReplies of replies.
func appendAppendReplies(b []byte, replies []appendAnswer) []byte {
	b = append(b, binAppendReplies)
	b = binary.AppendUvarint(b, uint64(len(replies)))
	for _, a := range replies {
		b = peer.AppendString(b, a.fault)
		resp := a.resp
		if resp == nil {
			resp = &raft.AppendEntriesResponse{}
		}
		b = binary.AppendUvarint(b, uint64(resp.ProtocolVersion))
		b = peer.AppendBytes(b, resp.ID)
		b = peer.AppendBytes(b, resp.Addr)
		b = binary.AppendUvarint(b, resp.Term)
		b = binary.AppendUvarint(b, resp.LastLog)
		var flags byte
		if resp.Success {
			flags |= 1
		}
		if resp.NoRetryBackoff {
			flags |= 2
		}
		b = append(b, flags)
	}
	return b
}

// decodeAppendReplies reads a binAppendReplies.
func decodeAppendReplies(b []byte) ([]appendAnswer, error) {
	if len(b) == 0 || b[0] != binAppendReplies {
		return nil, errBadCall
	}
	r := peer.NewReader(b[1:])
	replies := make([]appendAnswer, r.Count(7))
	for i := range replies {
		a := &replies[i]
		a.fault = r.String()
		a.resp = &raft.AppendEntriesResponse{}
		a.resp.ProtocolVersion = raft.ProtocolVersion(r.Uvarint())
		a.resp.ID = r.Bytes()
		a.resp.Addr = r.Bytes()
		a.resp.Term = r.Uvarint()
		a.resp.LastLog = r.Uvarint()
		flags := r.Byte()
		a.resp.Success = flags&1 != 0
		a.resp.NoRetryBackoff = flags&2 != 0
		if flags > 3 {
			r.Fail()
		}
	}
	if r.Bad() || r.Len() != 0 {
		return nil, errBadCall
	}
	return replies, nil
}

func cloneBytes(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return append([]byte(nil), b...)
}
