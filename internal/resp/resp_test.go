package resp

import (
	"bytes"
	"strings"
	"testing"
)

func TestParseRequestAcceptsSDKFraming(t *testing.T) {
	cases := []struct {
		in   string
		want []string
	}{
		{"*2\r\n$3\r\nGET\r\n$4\r\nkey1\r\n", []string{"GET", "key1"}},
		{"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n", []string{"SET", "k", ""}},
		{"*6\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\nNX\r\n$2\r\nPX\r\n$4\r\n1000\r\n", []string{"SET", "k", "v", "NX", "PX", "1000"}},
		{"*2\r\n$3\r\nGET\r\n$4\r\na\r\nb\r\n", []string{"GET", "a\r\nb"}}, // binary-safe
	}
	for _, c := range cases {
		got, err := ParseRequest([]byte(c.in))
		if err != nil {
			t.Fatalf("ParseRequest(%q): %v", c.in, err)
		}
		if len(got) != len(c.want) {
			t.Fatalf("ParseRequest(%q) = %q", c.in, got)
		}
		for i := range got {
			if string(got[i]) != c.want[i] {
				t.Fatalf("ParseRequest(%q)[%d] = %q, want %q", c.in, i, got[i], c.want[i])
			}
		}
	}
}

func TestParseRequestRejects(t *testing.T) {
	for _, in := range []string{
		"",
		"GET k",
		"*0\r\n",
		"*1\r\n",
		"*2147483647\r\n$3\r\nGET\r\n",
		"*99999999999999999999\r\n",
		"*-1\r\n",
		"*1\r\n$-1\r\n",
		"*1\r\n$3\r\nGE\r\n",
		"*1\r\n$3\r\nGETX\r\n",
		"*1\r\n$3\r\nGET\n",
		"*1\r\n$3\r\nGET\r\nextra",
		"*1\r\n+GET\r\n",
		"*1\r\n:1\r\n",
		"*1\r\n$99999999999\r\nGET\r\n",
		"*1\n$3\r\nGET\r\n",
		"*2\r\n$3\r\nGET\r\n",
		"*1\r\n$3",
		"*1\r\n$\r\nGET\r\n",
		"*" + strings.Repeat("9", 4000),
	} {
		if args, err := ParseRequest([]byte(in)); err != ErrSyntax {
			t.Errorf("ParseRequest(%q) = %q, %v; want syntax error", in, args, err)
		}
	}
}

func TestParseRequestArgsDoNotOverrunIntoEachOther(t *testing.T) {
	args, err := ParseRequest([]byte("*2\r\n$1\r\na\r\n$1\r\nb\r\n"))
	if err != nil {
		t.Fatal(err)
	}
	// Appending to one argument must not overwrite the next one.
	_ = append(args[0], 'X', 'X', 'X', 'X', 'X')
	if string(args[1]) != "b" {
		t.Fatalf("args[1] = %q after append to args[0]", args[1])
	}
}

func TestReplies(t *testing.T) {
	cases := []struct{ got, want string }{
		{string(OK), "+OK\r\n"},
		{string(MinusOne), ":-1\r\n"},
		{string(Nil), "$-1\r\n"},
		{string(Zero), ":0\r\n"},
		{string(One), ":1\r\n"},
		{string(AppendInt(nil, -1)), ":-1\r\n"},
		{string(AppendBulk(nil, []byte("hi"))), "$2\r\nhi\r\n"},
		{string(AppendBulk(nil, nil)), "$0\r\n\r\n"},
		{string(AppendError(nil, string(ErrSyntax))), "-ERR syntax error\r\n"},
		{string(AppendError(nil, "a\r\nb")), "-ERR a  b\r\n"},
		{string(AppendNotifySet(nil, []byte("v1"))), "*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$2\r\nv1\r\n"},
		{string(AppendNotifyDelete(nil)), "*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n"},
	}
	for _, c := range cases {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}

func TestErrorTextsAreTheSDKs(t *testing.T) {
	// The SDKs compare these byte for byte; a typo breaks every client.
	want := map[Error]string{
		ErrFencingTokenLowerVersion: "the request fencing token is a lower version than the fencing token protecting the resource",
		ErrTimestampSkew:            "the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized",
		ErrFencingTokenSkew:         "the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized",
		ErrMissingFencingToken:      "a fencing token is required for this request",
		ErrKeyLengthZero:            "the key length is zero",
	}
	for e, w := range want {
		if e.Error() != w {
			t.Errorf("%q != %q", e.Error(), w)
		}
	}
}

func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		"*2\r\n$3\r\nGET\r\n$4\r\nkey1\r\n",
		"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\nPX\r\n$4\r\n1000\r\n",
		"*3\r\n$9\r\nKEYNOTIFY\r\n$1\r\nk\r\n$4\r\nSTOP\r\n",
		"*2147483647\r\n",
		"*1\r\n$-1\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		args, err := ParseRequest(b)
		if err != nil {
			return
		}
		// Whatever parses re-encodes to exactly the input: the parser is
		// strict and accepts only canonical framing.
		if got := AppendBulks(nil, args...); !bytes.Equal(got, b) {
			t.Fatalf("re-encoded %q as %q", b, got)
		}
	})
}

func TestParseReply(t *testing.T) {
	cases := []struct {
		in   string
		want Value
	}{
		{"+OK\r\n", Value{Kind: SimpleString, Str: []byte("OK")}},
		{"-ERR syntax error\r\n", Value{Kind: ErrorReply, Str: []byte("syntax error")}},
		{":-1\r\n", Value{Kind: Integer, Int: -1}},
		{"$-1\r\n", Value{Kind: BulkString, Null: true}},
		{"$0\r\n\r\n", Value{Kind: BulkString, Str: []byte{}}},
		{"$3\r\na\r\n\r\n", Value{Kind: BulkString, Str: []byte("a\r\n")}},
	}
	for _, c := range cases {
		got, err := ParseReply([]byte(c.in))
		if err != nil || got.Kind != c.want.Kind || string(got.Str) != string(c.want.Str) || got.Null != c.want.Null || got.Int != c.want.Int {
			t.Errorf("ParseReply(%q) = %+v, %v", c.in, got, err)
		}
	}
	arr, err := ParseReply([]byte("*2\r\n*2\r\n$1\r\na\r\n$1\r\nb\r\n$3\r\ntok\r\n"))
	if err != nil || len(arr.Elems) != 2 || len(arr.Elems[0].Elems) != 2 || string(arr.Elems[1].Str) != "tok" {
		t.Fatalf("array: %+v %v", arr, err)
	}
	if v, _ := ParseReply([]byte("-ERR not authorized\r\n")); v.Err() != ErrNotAuthorized {
		t.Fatalf("Err() = %v", v.Err())
	}
	for _, bad := range []string{"", "+OK", "$5\r\nab\r\n", ":x\r\n", "*3\r\n:1\r\n", "+OK\r\nextra", "*2147483647\r\n", "?\r\n"} {
		if _, err := ParseReply([]byte(bad)); err == nil {
			t.Errorf("accepted %q", bad)
		}
	}
}

func FuzzParseReply(f *testing.F) {
	for _, s := range []string{"+OK\r\n", "$-1\r\n", "*1\r\n*2\r\n$1\r\na\r\n$1\r\nb\r\n", ":5\r\n", "-ERR x\r\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ParseReply(b) // must not panic or allocate without bound
	})
}

func TestParseReplyHugeLength(t *testing.T) {
	for _, in := range []string{"$9223372036854775807\r\n", "$9223372036854775806\r\nab\r\n", "*9223372036854775807\r\n"} {
		if _, err := ParseReply([]byte(in)); err == nil {
			t.Errorf("accepted %q", in)
		}
	}
}
