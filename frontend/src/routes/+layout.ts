// A static single-page app: everything renders in the browser, against the
// live API, so nothing is prerendered or server-rendered.
export const ssr = false;
export const prerender = false;
