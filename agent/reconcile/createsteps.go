package reconcile

import (
	"context"
	"fmt"
	"sync"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/sshcert"
	"github.com/a73x/eitri/wire/vmstate"
)

// createSteps are a create's steps, in the order they run.
var createSteps = []createStep{
	{name: "host key", run: (*createRun).hostKey},
	// Preflight comes before the slot queue and the download: a create that
	// can only be refused should cost nothing and wait for nothing.
	{name: "preflight", run: (*createRun).preflight},
	// So is the admission check, and for the same reason: a VM this host
	// has no room for fails now, with the numbers, not after its download.
	{name: "admission", run: (*createRun).admission},
	{name: "create slot", says: sayWaitingForSlot, run: (*createRun).createSlot},
	{name: "image", says: sayDownloading, sayFor: func(c *createRun) string { return c.e.imageWord(c.rec.Spec.ImageSHA256) }, run: (*createRun).image},
	{name: "root disk", says: sayPreparingDisk, run: (*createRun).rootDisk},
	{name: "certify", says: sayCertifying, when: (*createRun).uncertified, run: (*createRun).certify},
	{name: "seed", says: sayBuildingSeed, run: (*createRun).seed},
	{name: "boot", says: sayBooting, when: (*createRun).wantRunning, run: (*createRun).boot},
}

// hostKey gives the guest its SSH host key, kept across attempts, and
// records the VM before anything is done for it.
func (c *createRun) hostKey() error {
	if c.rec.HostPubKey == "" {
		pubKey, privKey, err := state.NewHostKey()
		if err != nil {
			return err
		}
		c.rec.HostPubKey, c.rec.HostPrivKey = pubKey, privKey
	}
	if err := c.e.cfg.St.SaveVM(c.id, c.rec); err != nil {
		// Without a durable record the host key would change on every try.
		c.e.log.Error("saving VM record", "vm", c.id, "err", err)
		return unsavedRecord{err}
	}
	return nil
}

// preflight asks the hypervisor whether this host can run the VM at all.
func (c *createRun) preflight() error {
	return c.e.cfg.Hyper.Preflight(c.ctx, c.rec.Spec)
}

// admission checks the VM fits beside what this host's VMs hold.
func (c *createRun) admission() error {
	return c.e.admitCreate(c.ctx, c.rec.Spec)
}

// createSlot waits for one of the host's create slots.
func (c *createRun) createSlot() error {
	release, err := c.e.acquireCreateSlot(c.ctx)
	if err != nil {
		return err
	}
	c.releaseSlot = release
	return nil
}

// acquireCreateSlot waits for a create slot. release may be called more
// than once; only the first gives the slot back.
func (e *Engine) acquireCreateSlot(ctx context.Context) (release func(), err error) {
	select {
	case e.slots <- struct{}{}:
		return sync.OnceFunc(func() { <-e.slots }), nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// image resolves the VM's image in the cache, downloading it if need be
// and counting the download out, and pins it. It stays pinned until the
// root disk holds it (the disk keeps its base alive itself) or the attempt
// fails, so the cache may evict it after.
func (c *createRun) image() error {
	base, release, err := c.e.cfg.Images(c.ctx, c.rec.Spec.ImageURL, c.rec.Spec.ImageSHA256, func(done, total int64) {
		c.measured(downloadDetail(done, total), downloadProgress(done, total))
	})
	if err != nil {
		return err
	}
	c.base, c.releaseImage = base, release
	return c.ctx.Err()
}

// imageWord is what fetching an image says as it begins: a cached image is
// only checked, not downloaded. Should the image go before it is fetched,
// the download's own progress says so at once.
func (e *Engine) imageWord(sha string) string {
	if e.cfg.ImageCached != nil && e.cfg.ImageCached(sha) {
		return sayCachedImage
	}
	return sayDownloading
}

// rootDisk builds the VM's root disk on the image.
func (c *createRun) rootDisk() error {
	err := c.e.cfg.Hyper.PrepareRootDisk(c.ctx, c.rec.Spec, c.base)
	c.unpinImage()
	return err
}

// uncertified: the guest has no host certificate yet and the control plane
// can sign one.
func (c *createRun) uncertified() bool {
	return c.rec.HostCert == "" && c.e.cfg.SignHostKey != nil
}

// certify has the control plane certify the guest's host key. It never
// fails the create: the guest is still reachable with its key pinned, and
// only the CA shortcut is missing. The next step's word says so.
func (c *createRun) certify() error {
	cert, err := c.e.certifyHostKey(c.ctx, c.id, c.rec.HostPubKey)
	if err != nil {
		c.e.log.Warn("SSH host key not certified", "vm", c.id, "err", err)
		c.note = "; " + sayUncertified + err.Error()
		return nil
	}
	c.rec.HostCert = cert
	c.e.save(c.id, c.rec)
	return nil
}

// seed writes the guest's cloud-init seed.
func (c *createRun) seed() error {
	if err := c.e.cfg.Seed(c.e.cfg.St.SeedPath(c.id), SeedParams{
		InstanceID:        c.id,
		Hostname:          c.rec.Spec.Name,
		SSHAuthorizedKey:  c.rec.Spec.SSHAuthorizedKey,
		HostPrivKey:       c.rec.HostPrivKey,
		HostPubKey:        c.rec.HostPubKey,
		LoginUser:         c.e.cfg.LoginUser,
		TrustedUserCAKeys: c.d.GetSshUserCaKeys(),
		UserCertPrincipal: sshcert.Principal(c.e.cfg.LoginUser, c.id),
		HostCertificate:   c.rec.HostCert,
	}); err != nil {
		return err
	}
	c.rec.LoginUser = c.e.cfg.LoginUser
	return nil
}

func (c *createRun) wantRunning() bool { return wantRunning(c.d) }

// boot starts the guest of a VM created wanted running; the hypervisor
// narrates what it waits for.
func (c *createRun) boot() error {
	say := sayer(c.ctx, c.pub, c.id, &c.rec, vmstate.PowerRunning, vmstate.PhaseCreating)
	if err := c.e.cfg.Hyper.Boot(withNarrator(c.ctx, say), c.rec.Spec, c.e.cfg.St.SeedPath(c.id)); err != nil {
		// A guest that died booting is an exit like any other: counted
		// and described, besides failing the attempt.
		c.rec = c.e.noteExit(c.ctx, c.rec)
		return err
	}
	c.rec.BootedAt = c.e.cfg.Now()
	c.rec.FirstBoot = true
	return nil
}

// downloadDetail words a download's progress. Both numbers share one unit,
// chosen from the larger, so they read as a fraction; with no known total
// only the part done is said.
func downloadDetail(done, total int64) string {
	div, unit := sizeUnit(max(done, total))
	if total <= 0 {
		return fmt.Sprintf("%s %.1f %s", sayDownloading, float64(done)/div, unit)
	}
	return fmt.Sprintf("%s %.1f/%.1f %s", sayDownloading, float64(done)/div, float64(total)/div, unit)
}

// stepDownload is Progress.step while the VM's image is fetched.
const stepDownload = "download"

// downloadProgress is the download's numbers as the row carries them, from
// the same report downloadDetail words: total is left unset when the server
// gave no length (the cache says -1), never sent as 0.
func downloadProgress(done, total int64) *eitriv1.Progress {
	p := &eitriv1.Progress{Step: stepDownload, DoneBytes: uint64(max(done, 0))}
	if total > 0 {
		t := uint64(total)
		p.TotalBytes = &t
	}
	return p
}

// sizeUnit is GiB from one GiB up, else MiB: images are never small enough
// for smaller units to read as anything but a stall.
func sizeUnit(n int64) (float64, string) {
	if n >= 1<<30 {
		return 1 << 30, "GiB"
	}
	return 1 << 20, "MiB"
}
