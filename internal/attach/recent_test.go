package attach

import (
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/statestore"
)

// TestRecentAnswersEachRequestOnce: the first delivery of a request is
// executed; one that comes while it runs waits for its reply, one that
// comes after gets the reply remembered; another requester's request with
// the same correlation data is another request; answers are forgotten
// once their time is up.
func TestRecentAnswersEachRequestOnce(t *testing.T) {
	c := newRecent()
	r := &statestore.Request{ClientID: "a", ResponseTopic: "r", QoS: 1, CorrelationData: []byte("c1"), MessageExpiry: 5}
	w1, w2 := &work{r: r}, &work{r: r}
	if first, _ := c.join(r, w1); !first {
		t.Fatal("the first delivery is not executed")
	}
	if first, done := c.join(r, w2); first || done != nil {
		t.Fatalf("a delivery while the first runs: first %v, answer %v", first, done)
	}
	other := &statestore.Request{ClientID: "b", ResponseTopic: "r", QoS: 1, CorrelationData: []byte("c1")}
	if first, _ := c.join(other, &work{r: other}); !first {
		t.Fatal("another requester's request taken for a repeat")
	}
	v := hlc.Timestamp{Wall: 1, Node: "n"}
	waiting := c.answer(r, []byte("+OK\r\n"), v)
	if len(waiting) != 2 || waiting[0] != w1 || waiting[1] != w2 {
		t.Fatalf("waiting for the reply: %v", waiting)
	}
	first, done := c.join(r, &work{r: r})
	if first || done == nil || string(done.payload) != "+OK\r\n" || done.version != v {
		t.Fatalf("a delivery after the reply: first %v, answer %+v", first, done)
	}
	c.expire(time.Now().Add(5 * time.Second)) // its expiry and a second
	if first, _ := c.join(r, &work{r: r}); first {
		t.Fatal("forgotten before its message expiry and a second")
	}
	c.expire(time.Now().Add(7 * time.Second))
	if first, _ := c.join(r, &work{r: r}); !first {
		t.Fatal("remembered past its expiry")
	}
	if remembered(&statestore.Request{ResponseTopic: "r", QoS: 1}) {
		t.Fatal("a request without correlation data remembered: all such would be one")
	}
}
