package httpkv

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"

	"github.com/mqkv/mqkv/internal/gateway"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/lease"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/store"
)

// Leases keeps the keys' leases (package lease).
type Leases interface {
	Get(ctx context.Context, key []byte) (lease.Record, hlc.Timestamp, bool, error)
	Do(ctx context.Context, key []byte, op lease.Op) (lease.Record, hlc.Timestamp, error)
	Drop(ctx context.Context, key []byte) error
	Now() int64
}

// Lease headers, as Azure's x-ms-lease-* without the vendor prefix.
const (
	hLeaseID       = "Mqkv-Lease-Id"
	hProposedID    = "Mqkv-Proposed-Lease-Id"
	hLeaseAction   = "Mqkv-Lease-Action"
	hLeaseDuration = "Mqkv-Lease-Duration"
	hBreakPeriod   = "Mqkv-Lease-Break-Period"
	hLeaseTime     = "Mqkv-Lease-Time"
	hLeaseState    = "Mqkv-Lease-State"
	hFence         = "Mqkv-Fencing-Token"
)

// param reads a request parameter from the query, or else a header.
func param(r *http.Request, query, header string) string {
	if v := r.URL.Query().Get(query); v != "" {
		return v
	}
	return r.Header.Get(header)
}

// leaseOp serves POST /v1/kv/{key}/lease.
func (s *Server) leaseOp(w http.ResponseWriter, r *http.Request, c *gateway.Client, key []byte) {
	if s.cfg.Leases == nil {
		fail(w, http.StatusNotImplemented, "not_implemented", "leases are not served here")
		return
	}
	if store.Reserved(key) || !c.Grant().CanAccess(key, policy.Write) {
		fail(w, http.StatusForbidden, "forbidden", "the policy does not let this user write this key")
		return
	}
	op := lease.Op{Action: strings.ToLower(param(r, "action", hLeaseAction)), ID: r.Header.Get(hLeaseID),
		ProposedID: param(r, "proposed-id", hProposedID), BreakPeriod: -1}
	if d := param(r, "duration", hLeaseDuration); d != "" || op.Action == "acquire" {
		n, err := strconv.ParseInt(d, 10, 64)
		if err != nil {
			fail(w, http.StatusBadRequest, "bad_request", "acquire needs a duration: 15 to 60 seconds, or -1 for ever")
			return
		}
		op.Duration = n
	}
	if b := param(r, "break-period", hBreakPeriod); b != "" {
		n, err := strconv.ParseInt(b, 10, 64)
		if err != nil || n < 0 {
			fail(w, http.StatusBadRequest, "bad_request", "a break period is 0 to 60 seconds")
			return
		}
		op.BreakPeriod = n
	}
	if op.Action == "acquire" {
		// Only an existing key is leased (as a blob is); the read is the
		// client's, so the policy decides it too.
		if v, _ := c.Call("", []byte("GET"), key); v.Kind == resp.ErrorReply {
			storeFail(w, v)
			return
		} else if v.Null {
			fail(w, http.StatusNotFound, "not_found", "no such key")
			return
		}
	}
	rec, ver, err := s.cfg.Leases.Do(r.Context(), key, op)
	if err != nil {
		leaseFail(w, err)
		return
	}
	if op.Action == "acquire" {
		// The key takes the new lease's version as its fence: a write
		// prepared under the lease's earlier state is refused by the store.
		if v := s.fenceKey(c, key, ver); v != nil {
			storeFail(w, *v)
			return
		}
	}
	now := s.cfg.Leases.Now()
	h := w.Header()
	h.Set(hLeaseState, rec.State(now))
	h.Set(hFence, ver.String())
	if rec.ID != "" && !rec.Released {
		h.Set(hLeaseID, rec.ID)
	}
	switch op.Action {
	case "acquire":
		w.WriteHeader(http.StatusCreated)
	case "break":
		h.Set(hLeaseTime, strconv.FormatInt(int64(rec.Remaining(now).Seconds()+0.999), 10))
		w.WriteHeader(http.StatusAccepted)
	default:
		w.WriteHeader(http.StatusOK)
	}
}

func leaseFail(w http.ResponseWriter, err error) {
	var le *lease.Error
	if errors.As(err, &le) {
		fail(w, le.Status, le.Code, le.Msg)
		return
	}
	fail(w, http.StatusServiceUnavailable, "unavailable", err.Error())
}

// fenceKey writes key again, as it is, with fence as its fencing token.
func (s *Server) fenceKey(c *gateway.Client, key []byte, fence hlc.Timestamp) *resp.Value {
	v, found := c.SetIfUnchanged(fence.String(), key, func(cur []byte) ([]byte, [][]byte) { return cur, nil })
	if found && v.Kind == resp.ErrorReply {
		return &v
	}
	return nil // written; or deleted meanwhile, nothing to protect
}

// leaseFence checks a write to key against its lease: while one is
// active, the request must name it (412 otherwise). It returns the
// fencing token the write carries: the lease record's version, or the
// client's own. ok false: answered.
func (s *Server) leaseFence(w http.ResponseWriter, r *http.Request, key []byte) (string, bool) {
	fence := r.Header.Get(hFence)
	if s.cfg.Leases == nil {
		return fence, true
	}
	rec, ver, exists, err := s.cfg.Leases.Get(r.Context(), key)
	if err != nil {
		storeFail(w, resp.Value{Kind: resp.ErrorReply, Str: []byte(err.Error())})
		return "", false
	}
	id := r.Header.Get(hLeaseID)
	switch active := exists && rec.Active(s.cfg.Leases.Now()); {
	case active && id == "":
		fail(w, http.StatusPreconditionFailed, "lease_id_missing", "the key is leased: the write needs its lease id ("+hLeaseID+")")
		return "", false
	case active && id != rec.ID:
		fail(w, http.StatusPreconditionFailed, "lease_id_mismatch", "the lease id is not the key's lease's")
		return "", false
	case !active && id != "":
		fail(w, http.StatusPreconditionFailed, "lease_not_present", "the key has no active lease")
		return "", false
	}
	if exists && (fence == "" || fenceBelow(fence, ver)) {
		fence = ver.String()
	}
	return fence, true
}

// fenceBelow says whether the client's token is below the lease's.
func fenceBelow(token string, lease hlc.Timestamp) bool {
	t, err := hlc.Parse(token)
	return err != nil || t.Compare(lease) < 0
}
