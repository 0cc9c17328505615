package statestore

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"hash/crc32"
	"strconv"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/store"
)

// SCAN limits.
const (
	scanDefaultCount = 100
	scanMaxCount     = 10_000
	// scanMaxExamined bounds the keys one page looks at, so a pattern that
	// matches rarely cannot hold the store's read lock for long: such a
	// page comes back short (even empty) with a token to go on.
	scanMaxExamined = 10 * scanMaxCount
)

// ErrBadToken answers SCAN with a continuation token mqkv did not issue.
const ErrBadToken resp.Error = "invalid continuation token"

// scan serves SCAN glob [token] [COUNT n] (the wire format the AIO SDKs are
// adopting, with mqkv's COUNT): keys matching glob in key order, a page at
// a time. Each page is read in one pass over the ordered keyspace, so a key
// present for the whole scan is returned exactly once. Only keys the client
// may read are returned.
func (s *Service) scan(r *Request, args [][]byte) {
	if len(args) < 2 || len(args) > 5 {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return
	}
	pattern := args[1]
	count := scanDefaultCount
	var after []byte
	haveToken, haveCount := false, false
	for i := 2; i < len(args); i++ {
		switch {
		case equalFold(args[i], "COUNT") && !haveCount && i+1 < len(args):
			n, err := strconv.Atoi(string(args[i+1]))
			if err != nil || n < 1 {
				s.fail(r, resp.ErrSyntax)
				return
			}
			count, haveCount = min(n, scanMaxCount), true
			i++
		case !haveToken:
			k, ok := s.tokens.decode(args[i])
			if !ok {
				s.fail(r, ErrBadToken)
				return
			}
			after, haveToken = k, true
		default:
			s.fail(r, resp.ErrSyntax)
			return
		}
	}
	if len(pattern) == 0 {
		s.fail(r, resp.ErrKeyLengthZero)
		return
	}
	m, e := s.compilePattern(r, pattern)
	if e != "" {
		s.fail(r, e)
		return
	}
	prefix := m.Prefix()
	from := prefix
	if haveToken {
		from = append(after[:len(after):len(after)], 0) // the first key after it
	}
	var keys [][]byte
	var last []byte // the last key examined: the next page starts after it
	more := false
	examined := 0
	ctx, cancel := context.WithTimeout(context.Background(), RequestTimeout)
	defer cancel()
	exhausted, err := s.router.Ascend(ctx, from, prefix, scanMaxExamined+1, func(e *store.Entry) bool {
		if len(keys) == count || examined == scanMaxExamined {
			more = true
			return false
		}
		examined++
		last = e.Key
		if m.Match(e.Key) && !store.Reserved(e.Key) && r.Grant.CanAccess(e.Key, policy.Read) {
			keys = append(keys, e.Key) // a key's bytes never change: no copy
		}
		return true
	})
	if err != nil {
		s.fail(r, unavailable(err))
		return
	}
	if !exhausted && last != nil {
		more = true // the router stopped early: go on after the last key seen
	}
	var token []byte
	if more {
		token = s.tokens.encode(last, r.Grant.CanAccess(last, policy.Read))
	}
	s.reply(r, scanReply(keys, token), hlc.Timestamp{})
}

// scanReply renders a page: *1 [keys] when it is the last, *2 [keys] token
// otherwise.
func scanReply(keys [][]byte, token []byte) []byte {
	n := 1
	if token != nil {
		n = 2
	}
	b := resp.AppendArrayHeader(nil, n)
	b = resp.AppendBulks(b, keys...)
	if token != nil {
		b = resp.AppendBulk(b, token)
	}
	return b
}

// Continuation tokens are the last key examined, with a format byte and a
// CRC-32C so that a token mqkv did not issue (or one damaged on the way) is
// refused instead of silently starting elsewhere. A client that forges one
// only chooses where its own scan resumes, and every key is still checked
// against its grant. But the last key examined may be one the client may
// not read (a page ends after examining scanMaxExamined keys, or where a
// cluster's group page ends): its name must not reach the client, so such
// a token is sealed (AES-GCM) under a key this server process draws at
// start. A sealed token is good only on the server that issued it, until
// it restarts; elsewhere it is refused and the client starts over.
const (
	tokenPlain  = 1
	tokenSealed = 2
	sealedBlock = 32 // a sealed token hides its key's length to within this
)

var (
	castagnoli = crc32.MakeTable(crc32.Castagnoli)
	// Strict: one token, one spelling.
	tokenEncoding = base64.RawURLEncoding.Strict()
)

// tokens issues and reads continuation tokens.
type tokens struct{ aead cipher.AEAD }

func newTokens() tokens {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		panic(err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		panic(err)
	}
	return tokens{aead}
}

// encode returns the token for a scan that goes on after key; readable
// says whether the client may read key (else its name is sealed).
func (t tokens) encode(key []byte, readable bool) []byte {
	var raw []byte
	if readable {
		raw = make([]byte, 0, 1+len(key)+4)
		raw = append(raw, tokenPlain)
		raw = append(raw, key...)
		raw = binary.BigEndian.AppendUint32(raw, crc32.Checksum(raw, castagnoli))
	} else {
		// The key's length, the key, and zeros to a multiple of
		// sealedBlock: the token's length says no more than that.
		plain := binary.AppendUvarint(nil, uint64(len(key)))
		plain = append(plain, key...)
		plain = append(plain, make([]byte, (sealedBlock-len(plain)%sealedBlock)%sealedBlock)...)
		n := t.aead.NonceSize()
		raw = make([]byte, 1+n, 1+n+len(plain)+t.aead.Overhead())
		raw[0] = tokenSealed
		if _, err := rand.Read(raw[1:]); err != nil {
			panic(err)
		}
		raw = t.aead.Seal(raw, raw[1:], plain, raw[:1])
	}
	out := make([]byte, tokenEncoding.EncodedLen(len(raw)))
	tokenEncoding.Encode(out, raw)
	return out
}

func (t tokens) decode(tok []byte) ([]byte, bool) {
	if bytes.ContainsAny(tok, "\r\n") { // which even a strict decoder skips
		return nil, false
	}
	raw := make([]byte, base64.RawURLEncoding.DecodedLen(len(tok)))
	n, err := tokenEncoding.Decode(raw, tok)
	if err != nil || n < 5 {
		return nil, false
	}
	raw = raw[:n]
	switch raw[0] {
	case tokenPlain:
		body, sum := raw[:n-4], binary.BigEndian.Uint32(raw[n-4:])
		if crc32.Checksum(body, castagnoli) != sum {
			return nil, false
		}
		return body[1:], true
	case tokenSealed:
		ns := t.aead.NonceSize()
		if n < 1+ns+t.aead.Overhead() {
			return nil, false
		}
		plain, err := t.aead.Open(nil, raw[1:1+ns], raw[1+ns:], raw[:1])
		if err != nil {
			return nil, false
		}
		size, n := binary.Uvarint(plain)
		if n <= 0 || size > uint64(len(plain)-n) {
			return nil, false
		}
		return plain[n : n+int(size) : n+int(size)], true
	}
	return nil, false
}
