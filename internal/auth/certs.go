package auth

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"

	"gopkg.in/yaml.v3"
)

// CertAttributes maps certificate subjects to principal attributes, as the
// AIO broker's X.509 authentication does: a client whose verified chain
// (its own certificate or any issuer above it) has a listed subject gets
// that entry's attributes.
type CertAttributes struct {
	entries []certEntry
}

type certEntry struct {
	subject    []attr // sorted, see canonicalSubject
	attributes map[string]string
}

// attr is one TYPE=value pair of a subject. Subjects are compared pair by
// pair, never as joined strings: a CN holding ",O=Contoso" must not pass
// for an O attribute.
type attr struct{ typ, value string }

func sortAttrs(a []attr) {
	sort.Slice(a, func(i, j int) bool {
		if a[i].typ != a[j].typ {
			return a[i].typ < a[j].typ
		}
		return a[i].value < a[j].value
	})
}

// ParseCertAttributes reads the YAML form, which is the AIO
// BrokerAuthentication x509Settings.authorizationAttributes map:
//
//	authorizationAttributes:
//	  root:
//	    subject: "CN = Contoso Root CA Cert, OU = Engineering, C = US"
//	    attributes:
//	      organization: contoso
//	  smart-fan:
//	    subject: "CN = smart-fan"
//	    attributes:
//	      building: "17"
func ParseCertAttributes(b []byte) (*CertAttributes, error) {
	var f struct {
		AuthorizationAttributes map[string]struct {
			Subject    string            `yaml:"subject"`
			Attributes map[string]string `yaml:"attributes"`
		} `yaml:"authorizationAttributes"`
	}
	if err := yaml.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("yaml: %w", err)
	}
	names := make([]string, 0, len(f.AuthorizationAttributes))
	for n := range f.AuthorizationAttributes {
		names = append(names, n)
	}
	sort.Strings(names)
	ca := &CertAttributes{}
	for _, n := range names {
		e := f.AuthorizationAttributes[n]
		s, err := canonicalSubject(e.Subject)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", n, err)
		}
		ca.entries = append(ca.entries, certEntry{subject: s, attributes: e.Attributes})
	}
	return ca, nil
}

// LoadCertAttributes reads a certificate attribute file.
func LoadCertAttributes(file string) (*CertAttributes, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("certificate attributes: %w", err)
	}
	ca, err := ParseCertAttributes(b)
	if err != nil {
		return nil, fmt.Errorf("certificate attributes %s: %w", file, err)
	}
	return ca, nil
}

// CertPrincipal returns the username (the leaf's subject CN) and attributes
// of a verified chain (leaf first).
func (ca *CertAttributes) CertPrincipal(chain []*x509.Certificate) (string, map[string]string) {
	if len(chain) == 0 {
		return "", nil
	}
	var attrs map[string]string
	if ca != nil {
		for _, c := range chain {
			s := subjectOf(c.Subject)
			for _, e := range ca.entries {
				if !slices.Equal(e.subject, s) {
					continue
				}
				if attrs == nil {
					attrs = map[string]string{}
				}
				for k, v := range e.attributes {
					attrs[k] = v
				}
			}
		}
	}
	return chain[0].Subject.CommonName, attrs
}

var attributeNames = map[string]string{
	"2.5.4.3": "CN", "2.5.4.6": "C", "2.5.4.7": "L", "2.5.4.8": "ST", "2.5.4.10": "O",
	"2.5.4.11": "OU", "2.5.4.5": "SERIALNUMBER", "2.5.4.9": "STREET", "2.5.4.17": "POSTALCODE",
	"0.9.2342.19200300.100.1.25": "DC", "0.9.2342.19200300.100.1.1": "UID",
}

// subjectOf returns a certificate subject's sorted TYPE=value pairs.
func subjectOf(n pkix.Name) []attr {
	var out []attr
	for _, atv := range n.Names {
		t := attributeNames[atv.Type.String()]
		if t == "" {
			t = atv.Type.String()
		}
		out = append(out, attr{t, fmt.Sprint(atv.Value)})
	}
	sortAttrs(out)
	return out
}

// canonicalSubject reads a subject as operators write it ("CN = x, OU = y"
// or "CN=x,OU=y"; a comma inside a value is written "\,") into sorted
// pairs.
func canonicalSubject(s string) ([]attr, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("empty subject")
	}
	var out []attr
	for _, p := range splitUnescaped(s) {
		k, v, ok := strings.Cut(p, "=")
		if !ok {
			return nil, fmt.Errorf("subject %q: %q is not TYPE=value", s, strings.TrimSpace(p))
		}
		k = strings.ToUpper(strings.TrimSpace(k))
		if !isOID(k) && !knownName(k) {
			return nil, fmt.Errorf("subject %q: unknown attribute type %q", s, k)
		}
		out = append(out, attr{k, strings.TrimSpace(v)})
	}
	sortAttrs(out)
	return out, nil
}

// splitUnescaped splits s at commas not preceded by a backslash, and
// unescapes "\,".
func splitUnescaped(s string) []string {
	var parts []string
	var cur strings.Builder
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == '\\' && i+1 < len(s) && s[i+1] == ',':
			cur.WriteByte(',')
			i++
		case s[i] == ',':
			parts = append(parts, cur.String())
			cur.Reset()
		default:
			cur.WriteByte(s[i])
		}
	}
	return append(parts, cur.String())
}

func knownName(k string) bool {
	for _, n := range attributeNames {
		if n == k {
			return true
		}
	}
	return false
}

// isOID reports whether s is a dotted object identifier (2.5.4.3).
func isOID(s string) bool {
	parts := strings.Split(s, ".")
	if len(parts) < 2 {
		return false
	}
	for _, p := range parts {
		var n int
		if _, err := fmt.Sscanf(p, "%d", &n); err != nil || fmt.Sprint(n) != p {
			return false
		}
	}
	return true
}
