// Package records holds what every kind of the server's own records in
// the replicated store shares (retained messages, client id ownership,
// sessions kept for other nodes, the metadata log's entries): their
// encoding, msgpack by field name after a format byte, so that a record
// of a format this release does not know is refused rather than misread;
// and the two store operations each needs, a write that waits for its
// outcome and a walk over a key prefix.
package records

import (
	"context"
	"fmt"

	"github.com/hashicorp/go-msgpack/v2/codec"

	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

var mh = &codec.MsgpackHandle{}

// Encode is v in format (the first byte), msgpack by field name after it.
func Encode(format byte, v any) []byte {
	var b []byte
	codec.NewEncoderBytes(&b, mh).MustEncode(v) // (it writes b from its start)
	return append([]byte{format}, b...)
}

// Decode reads a record of format into v; what names another format is
// refused, the error naming what (kind) was read.
func Decode(kind string, format byte, b []byte, v any) error {
	if len(b) == 0 || b[0] != format {
		return fmt.Errorf("%s: unknown format", kind)
	}
	return codec.NewDecoderBytes(b[1:], mh).Decode(v)
}

// Submitter proposes writes (statestore.Router's Submit).
type Submitter interface {
	Submit(ctx context.Context, p replica.Proposal)
}

// Submit proposes cmd and waits for its outcome, within ctx.
func Submit(ctx context.Context, r Submitter, cmd store.Command) (store.Result, error) {
	type outcome struct {
		res store.Result
		err error
	}
	ch := make(chan outcome, 1)
	r.Submit(ctx, replica.Proposal{Cmd: cmd, Done: func(res store.Result, err error) { ch <- outcome{res, err} }})
	select {
	case o := <-ch:
		return o.res, o.err
	case <-ctx.Done():
		return store.Result{}, ctx.Err()
	}
}

// Ascender walks keys (statestore.Router's Ascend).
type Ascender interface {
	Ascend(ctx context.Context, from, prefix []byte, limit int, fn func(*store.Entry) bool) (exhausted bool, err error)
}

// Scan calls fn with every live entry whose key starts with prefix, in key
// order, a page at a time.
func Scan(ctx context.Context, r Ascender, prefix []byte, fn func(*store.Entry)) error {
	var from []byte
	for {
		var last []byte
		exhausted, err := r.Ascend(ctx, from, prefix, 1000, func(e *store.Entry) bool {
			last = e.Key
			fn(e)
			return true
		})
		if err != nil {
			return err
		}
		if exhausted || last == nil {
			return nil
		}
		from = append(last[:len(last):len(last)], 0)
	}
}
