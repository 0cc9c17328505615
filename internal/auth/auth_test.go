package auth

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/crypto/bcrypt"

	"github.com/mqkv/mqkv/internal/testcerts"
)

func init() { cost = bcrypt.MinCost } // tests need not be slow on purpose

func TestPasswordFileRoundTrip(t *testing.T) {
	file := filepath.Join(t.TempDir(), "passwd")
	if err := SetPassword(file, "alice", []byte("s3cret")); err != nil {
		t.Fatal(err)
	}
	if err := SetPassword(file, "bob", []byte("hunter2")); err != nil {
		t.Fatal(err)
	}
	if err := SetPassword(file, "alice", []byte("changed")); err != nil { // replace
		t.Fatal(err)
	}
	p, err := LoadPasswords(file)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(p.sortedUsers(), ","); got != "alice,bob" {
		t.Fatalf("users %s", got)
	}
	for _, c := range []struct {
		user, pw string
		ok       bool
	}{{"alice", "changed", true}, {"alice", "s3cret", false}, {"bob", "hunter2", true}, {"bob", "", false}, {"carol", "x", false},
		// A password file sent as it is by an SDK ends with a newline.
		{"bob", "hunter2\n", true}, {"bob", "hunter2\r\n", true}, {"bob", "hunter\n", false}, {"bob", "\n", false}} {
		for i := 0; i < 2; i++ { // the second time through the cache
			if got := p.Check(c.user, []byte(c.pw)); got != c.ok {
				t.Fatalf("Check(%s, %s) = %v", c.user, c.pw, got)
			}
		}
	}
	if err := DeletePassword(file, "bob"); err != nil {
		t.Fatal(err)
	}
	p, _ = LoadPasswords(file)
	if p.Users() != 1 || p.Check("bob", []byte("hunter2")) {
		t.Fatal("bob still there")
	}
	if err := DeletePassword(file, "nobody"); err == nil {
		t.Fatal("deleting a missing user succeeded")
	}
	if fi, _ := os.Stat(file); fi.Mode().Perm() != 0o600 {
		t.Fatalf("password file mode %v", fi.Mode())
	}
	if err := SetPassword(file, "a:b", []byte("x")); err == nil {
		t.Fatal("username with ':' accepted")
	}
}

func TestParsePasswordsErrors(t *testing.T) {
	for _, in := range []string{
		"alice\n",
		":$2a$10$abcdefghijklmnopqrstuuOqJ8g6o3m9XyP4FzYQ2Z6H9XwZ6mCVa\n",
		"alice:plaintext\n",
		"alice:$2a$10$abc\n",
	} {
		if _, err := ParsePasswords([]byte(in)); err == nil {
			t.Errorf("accepted %q", in)
		}
	}
	p, err := ParsePasswords([]byte("# comment\n\n   \n"))
	if err != nil || p.Users() != 0 {
		t.Fatalf("comments: %v", err)
	}
}

func TestCertPrincipal(t *testing.T) {
	root, err := testcerts.NewCA(pkix.Name{CommonName: "Contoso Root CA Cert", OrganizationalUnit: []string{"Engineering"}, Country: []string{"US"}})
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := root.Client(pkix.Name{CommonName: "smart-fan"})
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(leaf.CertPEM)
	cert, _ := x509.ParseCertificate(block.Bytes)
	ca, err := ParseCertAttributes([]byte(`
authorizationAttributes:
  root:
    subject: "CN = Contoso Root CA Cert, OU = Engineering, C = US"
    attributes:
      organization: contoso
  smart-fan:
    subject: "CN = smart-fan"
    attributes:
      building: "17"
  other:
    subject: "CN = other"
    attributes:
      building: "1"
`))
	if err != nil {
		t.Fatal(err)
	}
	user, attrs := ca.CertPrincipal([]*x509.Certificate{cert, root.Cert})
	if user != "smart-fan" || attrs["organization"] != "contoso" || attrs["building"] != "17" || len(attrs) != 2 {
		t.Fatalf("principal %q %v", user, attrs)
	}
	// A CN that spells out another subject is not that subject.
	impostor, _ := root.Client(pkix.Name{CommonName: "Contoso Root CA Cert, OU = Engineering, C = US"})
	block, _ = pem.Decode(impostor.CertPEM)
	imp, _ := x509.ParseCertificate(block.Bytes)
	if _, attrs := ca.CertPrincipal([]*x509.Certificate{imp}); attrs["organization"] != "" {
		t.Fatalf("a CN with commas passed for the root's subject: %v", attrs)
	}
	if _, err := ParseCertAttributes([]byte("authorizationAttributes:\n  x:\n    subject: \"NOPE = y\"\n")); err == nil {
		t.Fatal("unknown subject attribute type accepted")
	}
}

func FuzzParsePasswords(f *testing.F) {
	f.Add([]byte("alice:$2a$10$N9qo8uLOickgx2ZMRZoMyeIjZAgcfl7p92ldGxad68LJZdL17lhWy\n# c\n"))
	f.Add([]byte("a:b:c\n"))
	f.Add([]byte(":\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := ParsePasswords(b)
		if err != nil {
			return
		}
		for _, u := range p.sortedUsers() {
			if u == "" || strings.Contains(u, ":") {
				t.Fatalf("bad username %q accepted", u)
			}
		}
	})
}

func FuzzParseCertAttributes(f *testing.F) {
	f.Add([]byte("authorizationAttributes:\n  a:\n    subject: \"CN = x, O = y\"\n    attributes: {k: v}\n"))
	f.Add([]byte("authorizationAttributes: {a: {subject: '1.2.3=x'}}"))
	f.Fuzz(func(t *testing.T, b []byte) {
		ca, err := ParseCertAttributes(b)
		if err != nil {
			return
		}
		ca.CertPrincipal(nil)
	})
}

// TestUnknownUserCostsAWrongPassword: a check for an unknown user
// compares against a hash of the file's cost, made beforehand at the
// default cost (a first miss must not cost a bcrypt more than a wrong
// password).
func TestUnknownUserCostsAWrongPassword(t *testing.T) {
	if c, err := bcrypt.Cost(defaultDummy); err != nil || c != bcrypt.DefaultCost || bcrypt.CompareHashAndPassword(defaultDummy, []byte("mqkv-dummy")) != nil {
		t.Fatalf("the default dummy hash: cost %d, %v", c, err)
	}
	h, _ := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost+1)
	p, err := ParsePasswords(fmt.Appendf(nil, "alice:%s\n", h))
	if err != nil {
		t.Fatal(err)
	}
	if p.Check("bob", []byte("pw")) {
		t.Fatal("an unknown user accepted")
	}
	if c, _ := bcrypt.Cost(dummyHash(p.cost)); c != bcrypt.MinCost+1 {
		t.Fatalf("an unknown user compared at cost %d, the file's is %d", c, bcrypt.MinCost+1)
	}
}
