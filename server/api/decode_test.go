package api_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// postRaw is curl with a body as typed, which may not be valid JSON.
func (e *env) postRaw(procedure, body string) (int, map[string]string) {
	e.t.Helper()
	var out map[string]string
	status := e.post(procedure, []byte(body), &out)
	return status, out
}

// A request JSON cannot decode is refused naming the field as the API
// spells it (mem_mb, never protojson's memMb), whichever spelling was sent.
func TestDecodeErrorsNameTheSnakeCaseField(t *testing.T) {
	e := newEnv(t)
	cases := []struct {
		procedure, body, want, never string
	}{
		{"/eitri.v1.VMService/CreateVM", `{"mem_mb":"lots"}`, `mem_mb: invalid value for int64 field: "lots" (line 1:11)`, "memMb"},
		{"/eitri.v1.VMService/CreateVM", `{"memMb":1.5}`, `mem_mb: invalid value for int64 field: 1.5`, "memMb"},
		{"/eitri.v1.VMService/CreateVM", `{"mem_mb":1,"memMb":2}`, `mem_mb: duplicate field`, "memMb"},
		{"/eitri.v1.VMService/CreateVM", `{"image_sha256":7}`, `image_sha256: invalid value for string field: 7`, "imageSha256"},
		{"/eitri.v1.VMService/CreateVM", `{"power_state":{}}`, `power_state: invalid value for string field`, "powerState"},
		{"/eitri.v1.VMService/CreateVM", "{\"name\":\"x\",\n \"ssh_authorized_key\": [1]}", `ssh_authorized_key: invalid value for string field: [ (line 2:24)`, "sshAuthorizedKey"},
		{"/eitri.v1.ExposureService/CreateExposure", `{"guest_port":"http"}`, `guest_port: invalid value`, "guestPort"},
		// A bad Duration names no field in protojson's words; the key
		// before the position does.
		{"/eitri.v1.TokenService/CreateToken", `{"name":"ci", "ttl":"soon"}`, `ttl: invalid google.protobuf.Duration value "soon"`, ""},
		{"/eitri.v1.HostService/CreateJoinToken", `{"ttl":3600}`, `ttl: `, ""},
		{"/eitri.v1.VMService/CreateVM", `{"name":"x"`, `invalid JSON: unexpected EOF`, ""},
		{"/eitri.v1.VMService/CreateVM", `[]`, `invalid JSON (line 1:1): unexpected token [`, ""},
	}
	for _, c := range cases {
		status, out := e.postRaw(c.procedure, c.body)
		assert.Equal(t, http.StatusBadRequest, status, c.body)
		assert.Equal(t, "invalid_argument", out["code"], c.body)
		assert.Contains(t, out["message"], c.want, c.body)
		if c.never != "" {
			assert.NotContains(t, out["message"], c.never, c.body)
		}
	}
	status, list := e.postJSON("/eitri.v1.VMService/ListVMs", map[string]any{})
	require.Equal(t, http.StatusOK, status)
	assert.Empty(t, list["vms"], "nothing was created")
}
