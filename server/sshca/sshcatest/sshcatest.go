// Package sshcatest holds what tests of SSH certificates share.
package sshcatest

import (
	"net"

	"golang.org/x/crypto/ssh"
)

// ConnMeta is the connection a certificate is checked for: only the user
// matters to ssh.CertChecker.Authenticate.
func ConnMeta(user string) ssh.ConnMetadata { return meta(user) }

type meta string

func (m meta) User() string        { return string(m) }
func (meta) SessionID() []byte     { return nil }
func (meta) ClientVersion() []byte { return nil }
func (meta) ServerVersion() []byte { return nil }
func (meta) RemoteAddr() net.Addr  { return &net.TCPAddr{} }
func (meta) LocalAddr() net.Addr   { return &net.TCPAddr{} }
