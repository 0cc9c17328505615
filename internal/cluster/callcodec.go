package cluster

import (
	"encoding/binary"
	"errors"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// The calls a node makes most, a write or a read forwarded to its group's
// leader, and their replies, have a binary form beside msgpack (see
// peer's binary forms). By reflection on field names, encoding and
// decoding a forwarded SET and its reply took 28 µs of CPU (callResp has
// 30 fields, all written), about a sixth of a three-node cluster's CPU
// per SET; the binary form takes about 1 µs.
//
// A node sends it once the cluster runs at protocolBinaryCalls (every
// member reads it), and answers a binary request in binary. Every
// release reads both forms.
//
// binCall: Op (byte), flags (bit 0 Relay), Group (uvarint), After
// (timestamp), Key (bytes), then for opSubmit Cmd as a log entry holds it
// (store.AppendCommand), as bytes.
//
// binReply: Kind (byte), flags (bit 0 Found, 1 HadPrevious, 2 DiskFull
// follows, 3 Repeated (protocol 4)), Err, Leader (strings), Result: Outcome (byte), Version
// (timestamp), Previous (bytes); Entry: Key, Value (bytes), Version,
// Fence (timestamps), ExpiresAt (varint); then, if flagged, DiskFull:
// Dir (string), Free, Reserve (uvarints).
//
// A timestamp is encoded as in a log entry (store.AppendTimestamp).
const (
	binCall  = 0x01
	binReply = 0x02
)

// protocolBinaryCalls is the cluster protocol from which members send
// binCall.
const protocolBinaryCalls = 2

var errBadCall = errors.New("cluster: malformed call")

// binaryCall reports whether req has a binary form: a forwarded write or
// read carries no field the form leaves out.
func binaryCall(req *callReq) bool { return req.Op == opSubmit || req.Op == opGet }

func readTimestamp(r *peer.Reader) hlc.Timestamp {
	return hlc.Timestamp{Wall: r.Varint(), Counter: r.Uvarint(), Node: r.String()}
}

// appendCall appends req's binary form; binaryCall(req) must hold.
func appendCall(b []byte, req *callReq) []byte {
	var flags byte
	if req.Relay {
		flags |= 1
	}
	b = append(b, binCall, byte(req.Op), flags)
	b = binary.AppendUvarint(b, uint64(req.Group))
	b = store.AppendTimestamp(b, req.After)
	b = peer.AppendBytes(b, req.Key)
	if req.Op == opSubmit {
		b = peer.AppendBytes(b, store.AppendCommand(nil, &req.Cmd))
	}
	return b
}

// decodeCall reads a call in either form; binary reports which. Byte
// slices of a binary call share b's memory.
func decodeCall(b []byte, req *callReq) (bin bool, err error) {
	if len(b) == 0 || b[0] != binCall {
		return false, peer.Decode(b, req)
	}
	r := peer.NewReader(b[1:])
	*req = callReq{Op: callOp(r.Byte())}
	flags := r.Byte()
	req.Relay = flags&1 != 0
	group := r.Uvarint()
	req.Group = int(group)
	req.After = readTimestamp(r)
	req.Key = r.Bytes()
	if req.Op == opSubmit {
		if req.Cmd, err = store.DecodeCommand(r.Bytes()); err != nil {
			return true, errBadCall
		}
	}
	if r.Bad() || r.Len() != 0 || flags>>1 != 0 || group > 1<<31 || !binaryCall(req) {
		return true, errBadCall
	}
	return true, nil
}

// appendReply appends resp's binary form: the fields a reply to a binCall
// sets (answer, submitHere, relay); no other.
func appendReply(b []byte, resp *callResp) []byte {
	var flags byte
	if resp.Found {
		flags |= 1
	}
	if resp.Result.HadPrevious {
		flags |= 2
	}
	if resp.DiskFull != nil {
		flags |= 4
	}
	if resp.Result.Repeated {
		flags |= 8
	}
	b = append(b, binReply, byte(resp.Kind), flags)
	b = peer.AppendString(b, resp.Err)
	b = peer.AppendString(b, resp.Leader)
	b = append(b, byte(resp.Result.Outcome))
	b = store.AppendTimestamp(b, resp.Result.Version)
	b = peer.AppendBytes(b, resp.Result.Previous)
	e := &resp.Entry
	b = peer.AppendBytes(b, e.Key)
	b = peer.AppendBytes(b, e.Value)
	b = store.AppendTimestamp(b, e.Version)
	b = store.AppendTimestamp(b, e.Fence)
	b = binary.AppendVarint(b, e.ExpiresAt)
	if d := resp.DiskFull; d != nil {
		b = peer.AppendString(b, d.Dir)
		b = binary.AppendUvarint(b, d.Free)
		b = binary.AppendUvarint(b, d.Reserve)
	}
	return b
}

// decodeReply reads a reply in either form. Byte slices of a binary reply
// share b's memory.
func decodeReply(b []byte, resp *callResp) error {
	if len(b) == 0 || b[0] != binReply {
		return peer.Decode(b, resp)
	}
	r := peer.NewReader(b[1:])
	*resp = callResp{Kind: errKind(r.Byte())}
	flags := r.Byte()
	resp.Found, resp.Result.HadPrevious, resp.Result.Repeated = flags&1 != 0, flags&2 != 0, flags&8 != 0
	resp.Err, resp.Leader = r.String(), r.String()
	resp.Result.Outcome = store.Outcome(r.Byte())
	resp.Result.Version = readTimestamp(r)
	resp.Result.Previous = r.Bytes()
	e := &resp.Entry
	e.Key, e.Value = r.Bytes(), r.Bytes()
	e.Version, e.Fence = readTimestamp(r), readTimestamp(r)
	e.ExpiresAt = r.Varint()
	if flags&4 != 0 {
		resp.DiskFull = &replica.DiskFullError{Dir: r.String(), Free: r.Uvarint(), Reserve: r.Uvarint()}
	}
	if r.Bad() || r.Len() != 0 || flags>>4 != 0 {
		return errBadCall
	}
	return nil
}
