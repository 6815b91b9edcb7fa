// Package jointoken is the one codec for join tokens: the pasteable string
// an admin hands to a new host, "eitri_join_" + base64url(binary
// eitri.v1.JoinToken). The control plane mints and spends them; the agent
// reads the URL and pin from one before it can talk to anybody.
package jointoken

import (
	"encoding/base64"
	"errors"
	"strings"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// Prefix starts every join token, so a leaked one says what it is (and
// secret scanners can find it).
const Prefix = "eitri_join_"

// Encode renders t as one pasteable string.
func Encode(t *eitriv1.JoinToken) string {
	b, _ := proto.Marshal(t) // a message of strings always marshals
	return Prefix + base64.RawURLEncoding.EncodeToString(b)
}

// Decode parses a pasted token (surrounding space is forgiven). A token
// without a secret is refused as damaged: nothing can spend it. The URL may
// be empty (a control plane that was not told its public address, as in
// tests); a client that must dial it checks with Dialable.
func Decode(s string) (*eitriv1.JoinToken, error) {
	raw, ok := strings.CutPrefix(strings.TrimSpace(s), Prefix)
	if !ok {
		return nil, errors.New("not an eitri join token (it starts with " + Prefix + ")")
	}
	t := &eitriv1.JoinToken{}
	b, err := base64.RawURLEncoding.DecodeString(raw)
	if err != nil || proto.Unmarshal(b, t) != nil || t.GetSecret() == "" {
		return nil, errors.New("join token is damaged; copy it again")
	}
	return t, nil
}

// URLs is every control-plane URL t names, the first the one to try
// first. A token from a control plane that knew one URL names only that.
func URLs(t *eitriv1.JoinToken) []string {
	if len(t.GetUrls()) > 0 {
		return t.GetUrls()
	}
	if t.GetUrl() != "" {
		return []string{t.GetUrl()}
	}
	return nil
}

// Dialable reports why an agent cannot enroll with t on its own, or nil.
func Dialable(t *eitriv1.JoinToken) error {
	if t.GetUrl() == "" {
		return errors.New("join token names no control plane URL; start the control plane with its public URL and create a new token")
	}
	return nil
}
