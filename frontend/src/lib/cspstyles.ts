// The console's CSP allows style sheets from 'self' only, so a <style>
// element a library adds at run time is refused (and reported). xterm.js
// draws its grid, theme and scroll bar with such elements, made when a
// terminal opens. So while it opens, withInertStyles hands it inert
// stand-ins instead (hidden <eitri-style> elements, which no policy
// governs), and mirrorStyles copies each stand-in's text (or a real
// <style>'s, should one be made later) into a constructable style sheet:
// those are made by script, and script is 'self'.

/** The part of Document mirrorStyles needs (a test passes its own). */
export type SheetHost = { adoptedStyleSheets: CSSStyleSheet[] };

const standIn = 'eitri-style';

/** Runs fn with document.createElement('style') making hidden stand-ins. */
export function withInertStyles<T>(fn: () => T, doc: Document = document): T {
	const create = doc.createElement;
	doc.createElement = function (this: Document, tag: string, options?: ElementCreationOptions) {
		if (tag.toLowerCase() !== 'style') return create.call(this, tag, options);
		const el = create.call(this, standIn, options);
		el.hidden = true;
		return el;
	} as typeof doc.createElement;
	try {
		return fn();
	} finally {
		doc.createElement = create;
	}
}

/** Keeps the styles under root applied until the returned function is
 *  called. */
export function mirrorStyles(root: HTMLElement, host: SheetHost = document, Sheet: typeof CSSStyleSheet = CSSStyleSheet): () => void {
	const mine = new Map<Element, CSSStyleSheet>();
	let owned = new Set<CSSStyleSheet>();
	const sync = () => {
		const present = new Set(root.querySelectorAll(`style, ${standIn}`));
		for (const el of present) {
			let sheet = mine.get(el);
			if (!sheet) {
				sheet = new Sheet();
				mine.set(el, sheet);
			}
			sheet.replaceSync(el.textContent ?? '');
		}
		for (const el of [...mine.keys()]) if (!present.has(el)) mine.delete(el);
		const ours = new Set(mine.values());
		host.adoptedStyleSheets = [...host.adoptedStyleSheets.filter((s) => !owned.has(s)), ...ours];
		owned = ours;
	};
	const mo = new MutationObserver(sync);
	mo.observe(root, { subtree: true, childList: true, characterData: true });
	sync();
	return () => {
		mo.disconnect();
		host.adoptedStyleSheets = host.adoptedStyleSheets.filter((s) => !owned.has(s));
		owned = new Set();
	};
}
