package retained

import (
	"fmt"
	"testing"

	"github.com/mqkv/mqkv/internal/mesh"
)

func TestEncodeDecode(t *testing.T) {
	m := &mesh.Message{Topic: "a/b", Payload: []byte("x"), QoS: 1, Retain: true, Expiry: 9, FormatSet: true, PayloadFormat: 1,
		ContentType: "c", ResponseTopic: "r", Correlation: []byte{0, 1}, User: [][2]string{{"k", "1"}, {"k", "2"}}}
	got, err := Decode(Encode(m))
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != fmt.Sprint(m) {
		t.Fatalf("got %+v, want %+v", got, m)
	}
}
