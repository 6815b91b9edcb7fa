package fleet

import (
	"bytes"
	"context"
	"regexp"
	"sync"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/release"
)

// MaxReleaseSize bounds one uploaded build. An eitri binary is a few tens
// of MiB; the bound keeps an upload (held whole, and in one database row)
// from costing the control plane more than that several times over.
const MaxReleaseSize = 256 << 20

// MaxSignatureSize bounds a signature file: a few short fields.
const MaxSignatureSize = 4 << 10

var sha256Hex = regexp.MustCompile(`^[0-9a-f]{64}$`)

// newestReleases is the newest version held for each platform, so a host
// row can say an update is available without a query per host.
type newestReleases struct {
	mu     sync.Mutex
	newest map[string]string // "os/arch" → version
}

func (n *newestReleases) set(list []store.Release) {
	m := map[string]string{}
	for _, r := range list {
		p := r.OS + "/" + r.Arch
		if c, ok := release.CompareVersions(r.Version, m[p]); m[p] == "" || (ok && c > 0) {
			m[p] = r.Version
		}
	}
	n.mu.Lock()
	n.newest = m
	n.mu.Unlock()
}

// newerThan reports a version held for the platform newer than version.
func (n *newestReleases) newerThan(platform, version string) bool {
	n.mu.Lock()
	v := n.newest[platform]
	n.mu.Unlock()
	c, ok := release.CompareVersions(v, version)
	return v != "" && ok && c > 0
}

// refreshReleases rereads what builds are held (after an upload, a delete,
// or another replica's).
func (f *Fleet) refreshReleases(ctx context.Context) error {
	list, err := f.st.ListReleases(ctx)
	if err != nil {
		return err
	}
	f.newest.set(list)
	return nil
}

// UploadRelease keeps a signed build. The signature must be the control
// plane's release key's and match the bytes exactly: a control plane hands
// out nothing its agents would refuse.
func (f *Fleet) UploadRelease(ctx context.Context, sigFile, data []byte) (*eitriv1.Release, error) {
	p, err := requireAdmin(ctx)
	if err != nil {
		return nil, err
	}
	sig, err := release.ParseSignature(sigFile)
	if err != nil {
		return nil, invalid("signature", "%v", err)
	}
	if f.cfg.ReleaseKey.IsZero() {
		return nil, errorf(Precondition, "this control plane has no release key to check builds with; start it with --release-key")
	}
	if err := f.cfg.ReleaseKey.Verify(sig); err != nil {
		return nil, errorf(Invalid, "%v", err)
	}
	d, err := release.Sum(bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	if err := sig.Matches(d); err != nil {
		return nil, errorf(Invalid, "%v", err)
	}
	r := store.Release{SHA256: sig.SHA256, Version: sig.Version, OS: sig.OS, Arch: sig.Arch, Size: sig.Size,
		KeyID: sig.KeyID, Signature: sigFile, UploadedBy: p.UserID, UploadedAt: f.now()}
	if err := f.st.CreateRelease(ctx, r, data); err != nil {
		return nil, storeErr(err, "release")
	}
	f.log.Info("release uploaded", "version", r.Version, "platform", r.OS+"/"+r.Arch, "sha256", r.SHA256, "by", p.UserID)
	if err := f.refreshReleases(ctx); err != nil {
		f.log.Warn("reread releases", "err", err)
	}
	f.publishAllHosts(ctx)
	return releaseView(r), nil
}

// ListReleases returns every build held.
func (f *Fleet) ListReleases(ctx context.Context) ([]*eitriv1.Release, error) {
	if _, err := principal(ctx); err != nil {
		return nil, err
	}
	list, err := f.st.ListReleases(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]*eitriv1.Release, len(list))
	for i, r := range list {
		out[i] = releaseView(r)
	}
	return out, nil
}

// DeleteRelease forgets a build no active rollout hands out.
func (f *Fleet) DeleteRelease(ctx context.Context, sha string) error {
	if _, err := requireAdmin(ctx); err != nil {
		return err
	}
	if !sha256Hex.MatchString(sha) {
		return invalid("sha256", "want 64 lowercase hex characters")
	}
	r, err := f.st.ReleaseBySHA256(ctx, sha)
	if err != nil {
		return storeErr(err, "release "+sha)
	}
	if ro, ok, err := f.st.ActiveRollout(ctx); err != nil {
		return err
	} else if ok && ro.Version == r.Version {
		return errorf(Precondition, "rollout %s is handing out %s; abort it first", ro.ID, r.Version)
	}
	if err := f.st.DeleteRelease(ctx, sha); err != nil {
		return storeErr(err, "release "+sha)
	}
	if err := f.refreshReleases(ctx); err != nil {
		f.log.Warn("reread releases", "err", err)
	}
	f.publishAllHosts(ctx)
	return nil
}

// ReleaseForHost returns a build's bytes for a host to download. Any
// enrolled host may fetch any build: builds are not secret, and the agent
// trusts only the signature.
func (f *Fleet) ReleaseForHost(ctx context.Context, sha string) (store.Release, []byte, error) {
	if !sha256Hex.MatchString(sha) {
		return store.Release{}, nil, errorf(NotFound, "no such release")
	}
	r, err := f.st.ReleaseBySHA256(ctx, sha)
	if err != nil {
		return store.Release{}, nil, storeErr(err, "release")
	}
	data, err := f.releaseData(ctx, sha)
	if err != nil {
		return store.Release{}, nil, storeErr(err, "release")
	}
	return r, data, nil
}

// releaseData keeps the last build read in memory: a rollout sends the
// same one to every host, and reading tens of MiB from the database for
// each would cost more than the download.
func (f *Fleet) releaseData(ctx context.Context, sha string) ([]byte, error) {
	f.lastRelease.mu.Lock()
	defer f.lastRelease.mu.Unlock()
	if f.lastRelease.sha == sha {
		return f.lastRelease.data, nil
	}
	data, err := f.st.ReleaseData(ctx, sha)
	if err != nil {
		return nil, err
	}
	f.lastRelease.sha, f.lastRelease.data = sha, data
	return data, nil
}

type cachedRelease struct {
	mu   sync.Mutex
	sha  string
	data []byte
}

func releaseView(r store.Release) *eitriv1.Release {
	return &eitriv1.Release{Version: r.Version, Os: r.OS, Arch: r.Arch, Size: r.Size, Sha256: r.SHA256, Signer: r.KeyID,
		UploadedAt: timestamppb.New(r.UploadedAt), UploadedBy: r.UploadedBy}
}

// publishAllHosts republishes every host row (what a host row says about
// updates changed for all of them).
func (f *Fleet) publishAllHosts(ctx context.Context) {
	hosts, err := f.st.ListHosts(ctx)
	if err != nil {
		return
	}
	for _, h := range hosts {
		if v, err := f.hostView(ctx, h); err == nil {
			f.Hosts.Publish(watch.Event[*eitriv1.Host]{ID: h.ID, Obj: v})
		}
	}
}
